#!/usr/bin/env bash
# Run 122 part 3: the TMA default (BF16 tiles by the tensor memory accelerator): gpu_check,
# model_parity, the prefill table with torch right after, TTFT against mma.sync in one call.
set -u
OUT=${OUT:-/tmp/out}; root=$(pwd); R=$OUT/raw; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader | tee $R/device.txt
t0=$(date +%s); el() { echo "t=$(( $(date +%s)-t0 ))"; }
cd $root/.gpuc11/new3 && xz -dkf *.xz && chmod +x gpu_check gpu_bench e2e_prefill model_parity && cp ../smollm2-6l.gguf.xz . && xz -dkf smollm2-6l.gguf.xz; el
timeout 150 ./gpu_check > $R/gpu_check.txt 2>&1; grep -E "FAIL|PASS" $R/gpu_check.txt | tail -4; el
timeout 60 ./model_parity --model smollm2-6l.gguf --tokens 48 > $R/model_parity.txt 2>&1; tail -1 $R/model_parity.txt; el
timeout 120 ./gpu_bench --prefill > $R/prefill.jsonl 2>$R/prefill.err; tail -2 $R/prefill.err; el
timeout 100 python3 $root/bench/gpu/torch_prefill.py > $R/torch_prefill.txt 2>&1; el
python3 - $R/prefill.jsonl $R/torch_prefill.txt <<'PY'
import json,sys
t={}
for l in open(sys.argv[2]):
    if l.startswith("{"):
        r=json.loads(l); t[(r["start"],r["rows"])]=r
for l in open(sys.argv[1]):
    r=json.loads(l)
    if r.get("bench")!="prefill": continue
    x=t.get((r["start"],r["rows"]))
    tv = "torch %.4f %.4f  x%.2f x%.2f" % (x["ms"], x["queued_ms"], x["ms"]/r["ms"], x["queued_ms"]/r["queued_ms"]) if x and r["work"]=="bf16" and r["kernel"]=="wgmma" else ""
    print(r["kernel"], r["work"], r["start"], r["rows"], "%.4f"%r["ms"], "%.4f"%r["queued_ms"], "%.0f"%r["tflops"], tv)
PY
timeout 120 ./e2e_prefill --runs 2 > $R/e2e_prefill.jsonl 2>$R/e2e_prefill.err; grep -o '"prompt":[0-9]*\|"prefill_kernel":"[a-z]*"\|"ttft_ms":[0-9.]*' $R/e2e_prefill.jsonl | paste - - -; el
NIBBLE_PREFILL_KERNEL=mma timeout 120 ./e2e_prefill --runs 1 >> $R/e2e_prefill.jsonl 2>>$R/e2e_prefill.err; grep -o '"prompt":[0-9]*\|"prefill_kernel":"[a-z]*"\|"ttft_ms":[0-9.]*' $R/e2e_prefill.jsonl | paste - - - | tail -2; el
cd $OUT && tar czf raw.tgz raw && rm -rf raw; ls -la $OUT
