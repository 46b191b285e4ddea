"""Checks that every NIBBLE_* variable the chart and the Dockerfile set is one the services read.

The chart configures the services only through environment variables, and the image sets its
container defaults the same way (`ENV` in the Dockerfile); a binary ignores a variable it does not
know, so a renamed or misspelled variable would silently drop a setting. This collects the
`env = "NIBBLE_..."` names the workspace's clap flags declare and fails on any rendered container
variable, or any `ENV` of the Dockerfile, that none declares.

    python check-env.py WORKSPACE_ROOT RENDERED.yaml...
"""

import pathlib
import re
import sys

import yaml

DECLARED = re.compile(r'env\s*=\s*"(NIBBLE_[A-Z0-9_]+)"')
# `ENV A=1 \` continuation lines of a Dockerfile, joined first.
DOCKER_ENV = re.compile(r"\b(NIBBLE_[A-Z0-9_]+)=")


def declared(root: pathlib.Path) -> set:
    names = set()
    for top in ("services", "shared"):
        for path in (root / top).rglob("*.rs"):
            names.update(DECLARED.findall(path.read_text(encoding="utf-8")))
    return names


def dockerfile_env(root: pathlib.Path) -> set:
    text = (root / "Dockerfile").read_text(encoding="utf-8").replace("\\\n", " ")
    names = set()
    for line in text.splitlines():
        if line.lstrip().startswith("ENV "):
            names.update(DOCKER_ENV.findall(line))
    return names


def main() -> int:
    root, *rendered = sys.argv[1:]
    root = pathlib.Path(root)
    known = declared(root)
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
                        if name not in known:
                            where = f"{obj['kind']}/{obj['metadata']['name']} container {container['name']}"
                            unknown.setdefault(name, where)
    image = dockerfile_env(root)
    if not image:
        unknown.setdefault("(none)", "the Dockerfile sets no NIBBLE_* variable with ENV")
    for name in image - known:
        unknown.setdefault(name, "Dockerfile ENV")
    for name, where in sorted(unknown.items()):
        print(f"UNKNOWN {name} ({where}): no flag declares it")
    print(
        f"{len(used)} NIBBLE_* variables set by the chart, {len(image)} by the Dockerfile, "
        f"{len(unknown)} unknown"
    )
    return 1 if unknown else 0


if __name__ == "__main__":
    sys.exit(main())
