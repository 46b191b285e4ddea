#!/usr/bin/env bash
# Run G4: the smallest check of decode-step graphs: model_parity with graphs on, and e2e decode
# (nvfp4, batch 1 and 8, 4K context) without then with graphs, tokens compared.
set -u
OUT=${OUT:-/tmp/out}; root=$(pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
t0=$(date +%s); el() { echo "t=$(( $(date +%s)-t0 ))"; }
cd $root/.gpuc5/bin && xz -dkf model_parity.xz e2e_decode.xz && chmod +x model_parity e2e_decode
NIBBLE_CUDA_GRAPHS=1 timeout 60 ./model_parity --model $root/.gpuc5/smollm2-6l.gguf --tokens 48 > $OUT/model_parity_graphs.txt 2>&1; tail -3 $OUT/model_parity_graphs.txt; el
timeout 120 ./e2e_decode --graphs both --dtypes nvfp4 --batches 1,8 --context 4096 --warmup 4 --steps 32 --no-baseline > $OUT/e2e_graphs.jsonl 2>$OUT/e2e_graphs.err
grep e2e_decode_graphs $OUT/e2e_graphs.jsonl | cut -c1-300; grep -i "graph\|error" $OUT/e2e_graphs.err | tail -5; el
