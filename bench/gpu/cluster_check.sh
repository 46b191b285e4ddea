#!/usr/bin/env bash
# The per-change GPU check of the whole cluster, on a machine with an NVIDIA GPU: `gpu_check`
# (kernels against the CPU), `model_parity` (greedy tokens on CPU and GPU for every KV dtype),
# then `nibble up --device cuda` with every prompt disaggregated: a long prompt's pages go from
# the prefill worker to the decode worker (and are checked there before they are trusted), and
# its greedy text must equal one engine's on the GPU and on the CPU.
#
#   bash bench/gpu/cluster_check.sh DIR OUT    # DIR holds nibble, gpu_check, model_parity and
#                                              # smollm2-6l.gguf (scripts/truncate_gguf.py ... 6)
set -uo pipefail

dir=$1
out=$2
model=$dir/smollm2-6l.gguf
status=0

"$dir/gpu_check" >"$out/gpu_check.txt" 2>&1 || status=1
echo "gpu_check: $(tail -1 "$out/gpu_check.txt")"
"$dir/model_parity" --model "$model" >"$out/model_parity.txt" 2>&1 || status=1
echo "model_parity: $(tail -1 "$out/model_parity.txt")"

prompt=$(python3 -c "print(' '.join(['It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.'] * 40))")
"$dir/nibble" up --model "$model" --device cuda --local-prefill-threshold 0 >"$out/up.log" 2>&1 &
up=$!
trap 'kill $up 2>/dev/null; wait 2>/dev/null' EXIT
for _ in $(seq 600); do
    grep -q "nibble up: ready" "$out/up.log" && break
    sleep 0.2
done
grep -q "nibble up: ready" "$out/up.log" || { echo "nibble up did not start"; tail -20 "$out/up.log"; exit 1; }
ask() { "$dir/nibble" generate --model "$model" --max-tokens 48 --temperature 0 "$@" "$prompt"; }
ask --url 127.0.0.1:50051 >"$out/cluster-1.txt" 2>"$out/cluster-1.err" || status=1
ask --url 127.0.0.1:50051 >"$out/cluster-2.txt" 2>"$out/cluster-2.err" || status=1
ask --device cuda >"$out/engine-cuda.txt" 2>"$out/engine-cuda.err" || status=1
ask --device cpu >"$out/engine-cpu.txt" 2>"$out/engine-cpu.err" || status=1
cat "$out"/cluster-1.err
for f in cluster-2 engine-cuda engine-cpu; do
    if cmp -s "$out/cluster-1.txt" "$out/$f.txt"; then echo "$f: same text"; else echo "$f: DIFFERENT text"; status=1; fi
done
curl -s 127.0.0.1:8000/metrics | grep -E "^nibble_worker_kv_transfer(s_refused|_bytes)_total" | tee "$out/transfer-metrics.txt"
grep -iE "refused|panicked|error" "$out/up.log" | head -5
exit $status
