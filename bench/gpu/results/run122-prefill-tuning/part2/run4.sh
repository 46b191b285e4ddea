#!/usr/bin/env bash
# Run 122 part 2: TMA staging of BF16 tiles (new2, gpu_check + the tuning sweep), the memory
# pool keeping freed memory (new2) against part 1's build (old): prefill, TTFT, decode at 32K.
set -u
OUT=${OUT:-/tmp/out}; root=$(pwd)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/device.txt
t0=$(date +%s); el() { echo "t=$(( $(date +%s)-t0 ))"; }
for d in old new2; do (cd $root/.gpuc11/$d && xz -dkf *.xz && chmod +x $(ls | grep -v xz)); done; el
N=$root/.gpuc11/new2; O=$root/.gpuc11/old
timeout 150 $N/gpu_check > $OUT/gpu_check.txt 2>&1; grep -E "FAIL|PASS" $OUT/gpu_check.txt | tail -4; grep -c "TMA" $OUT/gpu_check.txt; el
summ() { python3 - "$1" <<'PY'
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l)
    if r.get("bench")!="prefill" or r["kernel"]!="wgmma": continue
    print(r["work"], r.get("tma"), r.get("pingpong"), r.get("splits"), r["start"], r["rows"], "%.4f"%r["ms"], "%.4f"%r.get("queued_ms",0), "%.0f"%r["tflops"])
PY
}
timeout 200 $N/gpu_bench --prefill --prefill-tuning > $OUT/prefill_new.jsonl 2>$OUT/prefill_new.err; tail -2 $OUT/prefill_new.err; summ $OUT/prefill_new.jsonl; el
timeout 80 $O/gpu_bench --prefill > $OUT/prefill_old.jsonl 2>&1; summ $OUT/prefill_old.jsonl; el
timeout 100 python3 $root/bench/gpu/torch_prefill.py > $OUT/torch_prefill.txt 2>&1; cut -c1-150 $OUT/torch_prefill.txt; el
for v in old new2; do B=$root/.gpuc11/$v; timeout 100 $B/e2e_prefill --runs 2 > $OUT/e2e_prefill_$v.jsonl 2>$OUT/e2e_prefill_$v.err; grep '"e2e_prefill"' $OUT/e2e_prefill_$v.jsonl | grep -o '"prompt":[0-9]*\|"ttft_ms":[0-9.]*' | paste - - | sed "s/^/$v /"; el; done
sum() { grep -o '"dtype":"[a-z0-9]*","batch":[0-9]*,"context":[0-9]*,"steps":[0-9]*,"tokens_per_s":[0-9.]*' $1; }
for v in old new2; do B=$root/.gpuc11/$v; timeout 90 $B/e2e_decode --dtypes nvfp4 --batches 1,32 --warmup 4 --steps 32 > $OUT/e2e_decode_$v.jsonl 2>$OUT/e2e_decode_$v.err; sum $OUT/e2e_decode_$v.jsonl | sed "s/^/$v /"; el; done
