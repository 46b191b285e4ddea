#!/usr/bin/env bash
set -u
OUT=${OUT:-/tmp/out}; root=$(pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
cd $root/.gpuc6/bin && xz -dkf e2e_decode.xz && chmod +x e2e_decode
timeout 80 ./e2e_decode --graphs both --dtypes nvfp4 --batches 1,32 --warmup 2 --steps 16 --no-baseline > $OUT/e2e32k.jsonl 2>$OUT/e2e32k.err
grep '"e2e_decode_graphs"' $OUT/e2e32k.jsonl | cut -c1-240
