#!/usr/bin/env bash
# Run 124: norms and argmax with their loads in flight (new7) against HEAD (new5).
set -u
OUT=${OUT:-/tmp/out}; root=$(pwd); R=$OUT/raw; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv,noheader | tee $R/device.txt
t0=$(date +%s); el() { echo "t=$(( $(date +%s)-t0 ))"; }
for v in new5 new7; do s=$v; [ $v = new5 ] && s=old5; mkdir -p /tmp/$v && cp $root/.gpuc11/$s/*.xz /tmp/$v/ && (cd /tmp/$v && xz -dkf *.xz && chmod +x *); done
cp $root/.gpuc11/smollm2-6l.gguf.xz /tmp/ && xz -dkf /tmp/smollm2-6l.gguf.xz; el
sum() { python3 -c '
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l)
    if r.get("bench")=="e2e_decode" and "tokens_per_s" in r: print(sys.argv[2],r["dtype"],r["batch"],r["context"],r.get("graphs"),"%.1f"%r["tokens_per_s"],"%.3f"%r["ms_per_step"],r["seq0_tokens"][:4])
    elif r.get("bench")=="e2e_decode_graphs" and "speedup" in r: print("graphs",r["dtype"],r["batch"],r["tokens_identical"],"%.3f"%r["speedup"])
    elif "skipped" in r: print(r["dtype"],r["batch"],"skip")
' $1 $2; }
timeout 150 /tmp/new7/gpu_check > $R/gpu_check.txt 2>&1; grep -E "FAIL|PASS" $R/gpu_check.txt | tail -3; el
(cd /tmp/new7 && timeout 60 ./model_parity --model /tmp/smollm2-6l.gguf --tokens 48 > $R/model_parity.txt 2>&1); tail -1 $R/model_parity.txt; el
for i in 1 2; do for v in new5 new7; do
  timeout 80 /tmp/$v/e2e_decode --dtypes nvfp4 --batches 1,8 --context 32768 --warmup 3 --steps 24 --no-baseline > $R/ab_${v}_32k_$i.jsonl 2>$R/ab_${v}_32k_$i.err; sum $R/ab_${v}_32k_$i.jsonl $v
done; el; done
for v in new5 new7; do
  timeout 80 /tmp/$v/e2e_decode --dtypes nvfp4 --batches 1 --context 4096 --warmup 3 --steps 24 --no-baseline > $R/ab_${v}_4k.jsonl 2>$R/ab_${v}_4k.err; sum $R/ab_${v}_4k.jsonl $v
done; el
timeout 150 /usr/local/cuda/bin/ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base /tmp/new7/e2e_decode --dtypes nvfp4 --batches 1 --context 4096 --warmup 1 --steps 2 --no-baseline > $R/ncu_b1.csv 2>$R/ncu_b1.err; el
cd $OUT && tar czf raw.tgz raw && rm -rf raw; ls -la $OUT
