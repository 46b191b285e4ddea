// Validates ServiceMonitor objects against the prometheus-operator CRD schema (monitoring.coreos.com/v1,
// as published in @kubernetes-models/prometheus-operator). kubernetes-validate knows only the
// built-in kinds, so scripts/lint-deploy.sh hands ServiceMonitors here.
//
//   node servicemonitor-check.mjs OBJECTS.json   # a JSON array of objects; exit 1 if one is invalid
//
// Run from a directory whose node_modules holds the package (scripts/deploy-tools.sh copies it there).
import { readFileSync } from "node:fs";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";

const objects = JSON.parse(readFileSync(process.argv[2], "utf8"));
let failed = 0;
for (const object of objects) {
  const name = `ServiceMonitor/${object?.metadata?.name ?? "?"}`;
  try {
    new ServiceMonitor(object).validate();
    console.log(`${name}: valid against monitoring.coreos.com/v1`);
  } catch (error) {
    failed += 1;
    console.error(`${name}: ${error.message}`);
  }
}
process.exit(failed ? 1 : 0);
