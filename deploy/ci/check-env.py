"""Checks that every NIBBLE_* variable the chart sets is one the services read.

The chart configures the services only through environment variables, and a binary ignores a
variable it does not know, so a renamed or misspelled variable would silently drop a setting.
This collects the `env = "NIBBLE_..."` names the workspace's clap flags declare and fails on any
rendered container variable that is neither declared nor on PENDING (flags being added in
parallel). A pending name that is declared now is reported, so the list can shrink.

    python check-env.py WORKSPACE_ROOT RENDERED.yaml...
"""

import pathlib
import re
import sys

import yaml

# Flags the chart already sets ahead of the services (docs/DEPLOY.md, "Today, and what is landing").
PENDING: set[str] = set()

DECLARED = re.compile(r'env\s*=\s*"(NIBBLE_[A-Z0-9_]+)"')


def declared(root: pathlib.Path) -> set:
    names = set()
    for top in ("services", "shared"):
        for path in (root / top).rglob("*.rs"):
            names.update(DECLARED.findall(path.read_text(encoding="utf-8")))
    return names


def main() -> int:
    root, *rendered = sys.argv[1:]
    known = declared(pathlib.Path(root))
    unknown = {}
    used = set()
    for file in rendered:
        with open(file, encoding="utf-8") as f:
            for obj in yaml.safe_load_all(f):
                pod = (obj or {}).get("spec", {}).get("template", {}).get("spec", {})
                for container in pod.get("containers", []) + pod.get("initContainers", []):
                    for var in container.get("env", []):
                        name = var["name"]
                        if not name.startswith("NIBBLE_"):
                            continue
                        used.add(name)
                        if name not in known and name not in PENDING:
                            where = f"{obj['kind']}/{obj['metadata']['name']} container {container['name']}"
                            unknown.setdefault(name, where)
    for name in sorted(PENDING & known & used):
        print(f"note: {name} is declared by a flag now; remove it from PENDING in {__file__}")
    for name, where in sorted(unknown.items()):
        print(f"UNKNOWN {name} ({where}): no flag declares it and it is not pending")
    print(f"{len(used)} NIBBLE_* variables set by the chart, {len(unknown)} unknown")
    return 1 if unknown else 0


if __name__ == "__main__":
    sys.exit(main())
