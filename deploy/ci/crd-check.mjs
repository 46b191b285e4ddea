// Validates the custom resources the chart may render against their CRD schemas, as published in
// @kubernetes-models: ServiceMonitor (prometheus-operator, monitoring.coreos.com/v1) and
// ScaledObject (KEDA, keda.sh/v1alpha1). kubernetes-validate knows only the built-in kinds, so
// scripts/lint-deploy.sh hands these here; any other kind is an error, never a silent skip.
//
//   node crd-check.mjs OBJECTS.json   # a JSON array of objects; exit 1 if one is invalid
//
// Run from a directory whose node_modules holds the packages (scripts/deploy-tools.sh puts them there).
import { readFileSync } from "node:fs";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";
import { ScaledObject } from "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject";

const MODELS = {
  "monitoring.coreos.com/v1 ServiceMonitor": ServiceMonitor,
  "keda.sh/v1alpha1 ScaledObject": ScaledObject,
};

const objects = JSON.parse(readFileSync(process.argv[2], "utf8"));
let failed = 0;
for (const object of objects) {
  const kind = `${object?.apiVersion} ${object?.kind}`;
  const name = `${object?.kind}/${object?.metadata?.name ?? "?"}`;
  const Model = MODELS[kind];
  if (!Model) {
    failed += 1;
    console.error(`${name}: no CRD schema for ${kind}`);
    continue;
  }
  try {
    new Model(object).validate();
    console.log(`${name}: valid against ${object.apiVersion}`);
  } catch (error) {
    failed += 1;
    console.error(`${name}: ${error.message}`);
  }
}
process.exit(failed ? 1 : 0);
