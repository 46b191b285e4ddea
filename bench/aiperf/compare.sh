#!/usr/bin/env bash
# nibble bench checked against aiperf (PyPI: NVIDIA's benchmark client) in the same run: one
# `nibble up` (one core per worker, the default model on the CPU, every prompt prefilled on the
# prefill worker), the same load from both clients one after the other (streamed
# /v1/completions, ISL prompt tokens, OSL output tokens with EOS ignored, CONCURRENCY requests in
# flight, greedy), and their TTFT and ITL medians side by side. ITL is compared as aiperf
# defines it: each request's (last token - first token) / (tokens - 1), its median over requests.
# The cluster runs on core 0 and the clients on core 1 (taskset): aiperf's Python processes
# would otherwise take CPU from the workers on a two-core machine and slow the very requests it
# measures (on shared cores its TTFT and ITL medians came out 2.1x and 1.6x nibble bench's).
#
#   cargo build --release -p nibble
#   bash bench/aiperf/compare.sh
#
# Installs aiperf (and gguf, for the tokenizer) into $NIBBLE_AIPERF_VENV (default
# target/aiperf-venv) once. Results go to target/aiperf-compare/. Environment: CARGO_TARGET_DIR,
# CONCURRENCY (1: on two cores, a second request in flight makes every gap depend on whether it
# waits behind the other's prompt block), REQUESTS (32), ISL (256), OSL (64), ROUNDS (2: aiperf,
# nibble bench, aiperf, nibble bench, ... so that drift on a shared machine shows).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."

target=${CARGO_TARGET_DIR:-target}
nibble=$target/release/nibble
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
venv=${NIBBLE_AIPERF_VENV:-$target/aiperf-venv}
out=$target/aiperf-compare
concurrency=${CONCURRENCY:-1}
requests=${REQUESTS:-32}
isl=${ISL:-256}
osl=${OSL:-64}
rounds=${ROUNDS:-2}

[[ -x $nibble ]] || { echo "error: $nibble missing; cargo build --release -p nibble first" >&2; exit 1; }
[[ -s $model ]] || bash scripts/fetch-model.sh
if [[ ! -x $venv/bin/aiperf ]]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet aiperf gguf
fi

rm -rf "$out" && mkdir -p "$out"
"$venv/bin/python" bench/aiperf/gguf_tokenizer.py "$model" "$out/tokenizer"

port=18870
taskset -c 0 "$nibble" up --model "$model" --threads 1 --local-prefill-threshold 0 --listen 127.0.0.1:0 \
    --http-listen 127.0.0.1:$port \
    >"$out/up.log" 2>&1 &
up=$!
trap 'kill $up 2>/dev/null || true; wait 2>/dev/null || true' EXIT
for _ in $(seq 300); do
    grep -q "nibble up: ready" "$out/up.log" && break
    sleep 0.2
done
grep -q "nibble up: ready" "$out/up.log" || { echo "error: nibble up did not start" >&2; exit 1; }
name=$(basename "$model" .gguf)

for round in $(seq "$rounds"); do
    taskset -c 1 "$venv/bin/aiperf" profile --model "$name" --url http://127.0.0.1:$port \
        --endpoint-type completions --streaming --tokenizer "$out/tokenizer" \
        --synthetic-input-tokens-mean "$isl" --synthetic-input-tokens-stddev 0 \
        --output-tokens-mean "$osl" --output-tokens-stddev 0 \
        --extra-inputs ignore_eos:true temperature:0 \
        --concurrency "$concurrency" --request-count "$requests" --warmup-request-count 2 \
        --use-server-token-count --artifact-dir "$out/aiperf-$round" --ui-type none \
        >"$out/aiperf-$round.log" 2>&1
    taskset -c 1 "$nibble" bench --api openai --url http://127.0.0.1:$port --model "$model" \
        --input-tokens "$isl" --output-tokens "$osl" --concurrency "$concurrency" \
        --requests "$requests" --warmup 2 --seed "$round" --out "$out/nibble-$round" \
        >"$out/nibble-$round.log" 2>&1
done

"$venv/bin/python" - "$out" "$rounds" <<'EOF'
import glob, json, sys

out, rounds = sys.argv[1], int(sys.argv[2])
print("| round | client | TTFT p50 (ms) | ITL p50 (ms, per-request mean) | requests |")
print("|---|---|---|---|---|")
ratios = []
for r in range(1, rounds + 1):
    path = glob.glob(f"{out}/aiperf-{r}/**/profile_export_aiperf.json", recursive=True)[0]
    a = json.load(open(path))
    a_ttft, a_itl = a["time_to_first_token"]["p50"], a["inter_token_latency"]["p50"]
    n = json.load(open(f"{out}/nibble-{r}/summary.json"))[0]
    n_ttft = n["ttft_ms"]["p50"]
    # aiperf's ITL: per request, (end - first token) / (tokens - 1); the median over requests.
    means = sorted(
        sum(q["itl_ms"]) / len(q["itl_ms"])
        for q in map(json.loads, open(f"{out}/nibble-{r}/requests.jsonl"))
        if q["itl_ms"] and not q.get("error")
    )
    mid = len(means) // 2
    n_itl = means[mid] if len(means) % 2 else (means[mid - 1] + means[mid]) / 2
    print(f"| {r} | aiperf | {a_ttft:.1f} | {a_itl:.2f} | {a['request_count']['avg']:.0f} |")
    print(f"| {r} | nibble bench | {n_ttft:.1f} | {n_itl:.2f} | {n['requests']} |")
    ratios.append((n_ttft / a_ttft, n_itl / a_itl))
for r, (t, i) in enumerate(ratios, 1):
    print(f"round {r}: nibble bench / aiperf: TTFT p50 {t:.3f}, ITL p50 {i:.3f}")
EOF
