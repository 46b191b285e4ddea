#!/usr/bin/env bash
# Runs every test of the workspace, installing the system packages the build needs first.
#
#   bash scripts/test.sh            # from anywhere; extra arguments go to `cargo test`
#
# Works on a fresh Debian/Ubuntu machine with cargo present: missing packages are installed with
# apt-get (as root, or through sudo). Criterion benchmarks are built and run once each in test mode.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# What the build and tests need, as "command:debian-package". Nothing beyond cargo yet; the gRPC
# and discovery crates will add "protoc:protobuf-compiler" and "etcd:etcd-server".
REQUIRED_COMMANDS=()

# ensure_commands CMD:PKG...: apt-get installs the package of every command not on PATH.
ensure_commands() {
    local missing=() pair
    for pair in "$@"; do
        if ! command -v "${pair%%:*}" >/dev/null 2>&1; then
            missing+=("${pair#*:}")
        fi
    done
    if ((${#missing[@]} == 0)); then
        return 0
    fi
    local sudo=()
    if ((EUID != 0)); then
        sudo=(sudo)
    fi
    echo "installing missing packages: ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get update
    "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
}

if ! command -v cargo >/dev/null 2>&1; then
    echo "error: cargo not found on PATH; install Rust from https://rustup.rs" >&2
    exit 1
fi

ensure_commands "${REQUIRED_COMMANDS[@]}"

cargo test --workspace --all-targets "$@"
