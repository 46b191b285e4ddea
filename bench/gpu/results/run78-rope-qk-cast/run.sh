#!/bin/bash
# run 78: rope_qk + the decode's fused BF16 output cast (d) against PDL alone (b); parity; ncu
O=$OUT; cd .devrun
gunzip b/*.gz d/*.gz
timeout 120 d/gpu_check > $O/check.log 2>&1; echo "check rc=$?" >> $O/rc.txt
timeout 200 d/model_parity --model smollm2-6l.gguf --tokens 64 > $O/parity6.txt 2>&1; echo "parity rc=$?" >> $O/rc.txt
tail -2 $O/check.log; grep -E "rope_qk|PARITY|MISMATCH|FAIL" $O/parity6.txt | head
for i in 1 2; do
  timeout 100 b/e2e_decode --dtypes nvfp4 --batches 1,8 > $O/e2e_b_$i.jsonl 2>/dev/null; echo "b$i rc=$?" >> $O/rc.txt
  timeout 100 d/e2e_decode --dtypes nvfp4 --batches 1,8 > $O/e2e_d_$i.jsonl 2>/dev/null; echo "d$i rc=$?" >> $O/rc.txt
done
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
timeout 120 $NCU --clock-control none --metrics gpu__time_duration.sum -k regex:decode d/gpu_bench --profile --dtypes nvfp4 --shapes 1x4096,1x32768,8x32768 > $O/ncu.txt 2>&1; echo "ncu rc=$?" >> $O/rc.txt
grep -E "decode_|gpu__time_duration" $O/ncu.txt | paste - - | awk '{print $1, $(NF-1), $NF}' | head -40
cat $O/rc.txt
for f in $O/e2e_*.jsonl; do echo $f; python3 -c "
import json
for l in open('$f'):
    d=json.loads(l)
    if d.get('bench')=='e2e_decode': print(d['batch'], round(d['tokens_per_s'],1), round(d['ms_per_step'],3), round(d.get('baseline_ms_per_step',0),3))
"; done
