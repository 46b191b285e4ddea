"""Validates rendered Kubernetes manifests: every object against the Kubernetes JSON schemas of the
given versions (kubernetes-validate, strict: unknown fields are errors), except the custom
resources the chart may render (ServiceMonitor, KEDA's ScaledObject), which are written to a JSON
file for crd-check.mjs. Any other kind without a schema is an error, never a silent skip.

    python validate-manifests.py RENDERED.yaml CUSTOM-RESOURCES.json 1.27.0 1.37.0

Exit status 1 when an object is invalid or of an unknown kind; prints one line per object.
"""

import json
import sys

import kubernetes_validate
import yaml

# Kinds validated elsewhere: the CRDs the chart may render.
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("keda.sh/v1alpha1", "ScaledObject"),
}


def main() -> int:
    rendered, crd_out, *versions = sys.argv[1:]
    with open(rendered, encoding="utf-8") as f:
        objects = [o for o in yaml.safe_load_all(f) if o]
    if not objects:
        print(f"{rendered}: no objects rendered", file=sys.stderr)
        return 1
    failures = 0
    crds = []
    for obj in objects:
        name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        if (obj.get("apiVersion"), obj.get("kind")) in CRD_KINDS:
            crds.append(obj)
            continue
        for version in versions:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                failures += 1
                path = ".".join(str(p) for p in e.path)
                print(f"INVALID {name} (Kubernetes {version}): {path}: {e.message}")
            except kubernetes_validate.SchemaNotFoundError:
                failures += 1
                print(f"UNKNOWN {name}: no schema for {obj.get('apiVersion')} in Kubernetes {version}")
    with open(crd_out, "w", encoding="utf-8") as f:
        json.dump(crds, f)
    checked = len(objects) - len(crds)
    print(f"{rendered}: {checked} objects checked against Kubernetes {', '.join(versions)}, "
          f"{len(crds)} custom resource(s) left to the CRD check, {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
