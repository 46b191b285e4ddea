#!/usr/bin/env bash
# Run 122 part 1: checks of the runtime ping-pong flag and tuning overrides, model_parity,
# the prefill sweep with every tuning, torch's SDPA, TTFT.
set -u
OUT=${OUT:-/tmp/out}; root=$(pwd)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/device.txt
t0=$(date +%s); el() { echo "t=$(( $(date +%s)-t0 ))"; }
cd $root/.gpuc11 && xz -dkf gpu_check.xz model_parity.xz gpu_bench.xz e2e_prefill.xz smollm2-6l.gguf.xz && chmod +x gpu_check model_parity gpu_bench e2e_prefill; el
timeout 150 ./gpu_check > $OUT/gpu_check.txt 2>&1; grep -E "FAIL|PASS" $OUT/gpu_check.txt | tail -3; grep -c "ping-pong" $OUT/gpu_check.txt; el
timeout 60 ./model_parity --model smollm2-6l.gguf --tokens 48 > $OUT/model_parity.txt 2>&1; tail -2 $OUT/model_parity.txt; el
timeout 200 ./gpu_bench --prefill --prefill-tuning > $OUT/prefill.jsonl 2>$OUT/prefill.err; tail -2 $OUT/prefill.err; el
python3 - $OUT/prefill.jsonl <<'PY'
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l)
    if r.get("bench")!="prefill" or r["kernel"]!="wgmma": continue
    print(r["work"], r.get("pingpong"), r.get("splits"), r["start"], r["rows"], "%.4f"%r["ms"], "%.4f"%r["min_ms"], "%.0f"%r["tflops"])
PY
timeout 80 python3 $root/bench/gpu/torch_prefill.py > $OUT/torch_prefill.txt 2>&1; cat $OUT/torch_prefill.txt | tail -8; el
timeout 170 ./e2e_prefill --runs 2 > $OUT/e2e_prefill.jsonl 2>$OUT/e2e_prefill.err; grep '"e2e_prefill"' $OUT/e2e_prefill.jsonl | cut -c1-240; el
