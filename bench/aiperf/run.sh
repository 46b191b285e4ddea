#!/usr/bin/env bash
# A short aiperf (PyPI: NVIDIA's benchmark client) profile of the router's OpenAI-compatible
# HTTP API, on one machine: etcd, one prefill worker, one decode worker and the router, from
# target/release, serving models/SmolLM2-135M-Instruct.Q4_1.gguf on the CPU.
#
#   cargo build --release -p nibble-router -p nibble-prefill -p nibble-decode
#   bash bench/aiperf/run.sh [extra aiperf arguments]
#
# Installs aiperf (and gguf, for the tokenizer) into a virtual environment under
# $NIBBLE_AIPERF_VENV (default target/aiperf-venv) once. Results go to target/aiperf/.
# Environment: CARGO_TARGET_DIR (binaries), NIBBLE_THREADS (engine threads per worker, 1),
# CONCURRENCY (4), REQUESTS (32), ISL (128 synthetic prompt tokens), OSL (64 output tokens).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."

target=${CARGO_TARGET_DIR:-target}
bin=$target/release
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
venv=${NIBBLE_AIPERF_VENV:-$target/aiperf-venv}
out=$target/aiperf
threads=${NIBBLE_THREADS:-1}

for b in nibble-router nibble-prefill nibble-decode; do
    [[ -x $bin/$b ]] || { echo "error: $bin/$b missing; cargo build --release first" >&2; exit 1; }
done
[[ -s $model ]] || bash scripts/fetch-model.sh
command -v etcd >/dev/null || bash scripts/deps.sh
if [[ ! -x $venv/bin/aiperf ]]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet aiperf gguf
fi

rm -rf "$out" && mkdir -p "$out"
"$venv/bin/python" bench/aiperf/gguf_tokenizer.py "$model" "$out/tokenizer"

pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT

etcd --data-dir "$out/etcd" --listen-client-urls http://127.0.0.1:23891 \
    --advertise-client-urls http://127.0.0.1:23891 --listen-peer-urls http://127.0.0.1:23892 \
    --initial-advertise-peer-urls http://127.0.0.1:23892 \
    --initial-cluster default=http://127.0.0.1:23892 >"$out/etcd.log" 2>&1 &
pids+=($!)
export NIBBLE_ETCD_ENDPOINTS=http://127.0.0.1:23891 NIBBLE_MODEL=$model NIBBLE_MODEL_NAME=smollm2
sleep 2
"$bin/nibble-prefill" --threads "$threads" >"$out/prefill.log" 2>&1 &
pids+=($!)
"$bin/nibble-decode" --threads "$threads" >"$out/decode.log" 2>&1 &
pids+=($!)
"$bin/nibble-router" --listen 127.0.0.1:0 --http-listen 127.0.0.1:18800 >"$out/router.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
    curl -sf http://127.0.0.1:18800/ready >/dev/null && break
    sleep 0.2
done
curl -sf http://127.0.0.1:18800/ready

"$venv/bin/aiperf" profile --model smollm2 --url http://127.0.0.1:18800 \
    --endpoint-type chat --streaming --tokenizer "$out/tokenizer" \
    --synthetic-input-tokens-mean "${ISL:-128}" --synthetic-input-tokens-stddev 0 \
    --output-tokens-mean "${OSL:-64}" --output-tokens-stddev 0 --extra-inputs ignore_eos:true \
    --concurrency "${CONCURRENCY:-4}" --request-count "${REQUESTS:-32}" --warmup-request-count 2 \
    --use-server-token-count --artifact-dir "$out/artifacts" --ui-type simple "$@"
