#!/usr/bin/env bash
# Checks and the decode table (issue 23): gpu_check, model_parity with and without graphs,
# e2e_decode at 16K for every dtype, graphs both for nvfp4.
set -u
OUT=${OUT:-/tmp/out}; root=$(pwd)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee $OUT/device.txt
t0=$(date +%s); el() { echo "t=$(( $(date +%s)-t0 ))"; }
cd $root/.gpuc7/bin && xz -dkf gpu_check.xz model_parity.xz e2e_decode.xz && chmod +x gpu_check model_parity e2e_decode
M=$root/.gpuc7/smollm2-6l.gguf
timeout 120 ./gpu_check > $OUT/gpu_check.txt 2>&1; grep -E "FAIL|PASS" $OUT/gpu_check.txt | tail -3; el
timeout 60 ./model_parity --model $M --tokens 48 > $OUT/model_parity.txt 2>&1; tail -1 $OUT/model_parity.txt; el
NIBBLE_CUDA_GRAPHS=1 timeout 60 ./model_parity --model $M --tokens 48 > $OUT/model_parity_graphs.txt 2>&1; tail -1 $OUT/model_parity_graphs.txt; el
sum() { grep -o '"dtype":"[a-z0-9]*","batch":[0-9]*,"context":[0-9]*,"steps":[0-9]*,"tokens_per_s":[0-9.]*\|"skipped":"[^"]*"\|"graphs":[a-z]*' $1 | paste - - ; grep '"e2e_decode_graphs"' $1 | cut -c1-240; }
timeout 200 ./e2e_decode --dtypes bf16,fp8,nvfp4 --batches 1,8,32,64 --context 16384 --warmup 4 --steps 32 > $OUT/e2e16k.jsonl 2>$OUT/e2e16k.err; sum $OUT/e2e16k.jsonl; el
timeout 150 ./e2e_decode --graphs both --dtypes nvfp4 --batches 1,8,32,64 --context 16384 --warmup 4 --steps 32 --no-baseline > $OUT/e2e16k_graphs.jsonl 2>$OUT/e2e16k_graphs.err; sum $OUT/e2e16k_graphs.jsonl; el
