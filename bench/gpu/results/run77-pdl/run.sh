#!/bin/bash
# run 77: programmatic dependent launch (PDL) off / on / on + weight prefetch
O=$OUT; cd .devrun
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv > $O/smi.txt
timeout 120 c/gpu_check > $O/check.log 2>&1; echo "check rc=$?" >> $O/rc.txt
tail -3 $O/check.log
for i in 1 2; do
  NIBBLE_CUDA_PDL=0 timeout 100 c/e2e_decode --dtypes nvfp4 --batches 1,8 > $O/e2e_off_$i.jsonl 2>>$O/e2e.err; echo "off$i rc=$?" >> $O/rc.txt
  timeout 100 b/e2e_decode --dtypes nvfp4 --batches 1,8 > $O/e2e_b_$i.jsonl 2>>$O/e2e.err; echo "b$i rc=$?" >> $O/rc.txt
  timeout 100 c/e2e_decode --dtypes nvfp4 --batches 1,8 > $O/e2e_c_$i.jsonl 2>>$O/e2e.err; echo "c$i rc=$?" >> $O/rc.txt
  if [ $i = 1 ]; then
    NIBBLE_CUDA_PDL=0 timeout 90 c/gpu_bench --dtypes nvfp4 > $O/bench_off.jsonl 2>>$O/bench.err; echo "bench_off rc=$?" >> $O/rc.txt
    timeout 90 c/gpu_bench --dtypes nvfp4 > $O/bench_on.jsonl 2>>$O/bench.err; echo "bench_on rc=$?" >> $O/rc.txt
  fi
done
cat $O/rc.txt
for f in $O/e2e_*.jsonl; do echo $f; python3 -c "
import json,sys
for l in open('$f'):
    d=json.loads(l)
    if d.get('bench')=='e2e_decode': print(d['batch'], round(d['tokens_per_s'],1), round(d['ms_per_step'],3), round(d.get('baseline_ms_per_step',0),3))
"; done
