#!/usr/bin/env bash
# TTFT (issue 23): e2e_prefill 4K and 32K, the wgmma default (BF16 work) and the mma.sync fallback;
# decode at 32K batch 1/8/32 nvfp4 and fp8.
set -u
OUT=${OUT:-/tmp/out}; root=$(pwd)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee $OUT/device.txt
t0=$(date +%s); el() { echo "t=$(( $(date +%s)-t0 ))"; }
cd $root/.gpuc7/bin && xz -dkf e2e_prefill.xz e2e_decode.xz && chmod +x e2e_prefill e2e_decode
timeout 150 ./e2e_prefill --runs 2 > $OUT/e2e_prefill.jsonl 2>$OUT/e2e_prefill.err; grep '"e2e_prefill"' $OUT/e2e_prefill.jsonl | cut -c1-220; el
NIBBLE_PREFILL_KERNEL=mma timeout 150 ./e2e_prefill --runs 1 >> $OUT/e2e_prefill.jsonl 2>>$OUT/e2e_prefill.err; grep '"e2e_prefill"' $OUT/e2e_prefill.jsonl | tail -2 | cut -c1-220; el
sum() { grep -o '"dtype":"[a-z0-9]*","batch":[0-9]*,"context":[0-9]*,"steps":[0-9]*,"tokens_per_s":[0-9.]*\|"skipped":"[^"]*"\|"graphs":[a-z]*' $1 | paste - - ; }
timeout 220 ./e2e_decode --dtypes fp8,nvfp4 --batches 1,8,16,32 --warmup 4 --steps 32 > $OUT/e2e32k.jsonl 2>$OUT/e2e32k.err; sum $OUT/e2e32k.jsonl; el
