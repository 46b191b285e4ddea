#!/bin/bash
# run 79: decode_combine over (d, group) blocks + page ids before the context length (e) vs d
O=$OUT; cd .devrun
gunzip d/*.gz e/*.gz
timeout 120 e/gpu_check > $O/check.log 2>&1; echo "check rc=$?" >> $O/rc.txt
timeout 200 e/model_parity --model smollm2-6l.gguf --tokens 64 > $O/parity6.txt 2>&1; echo "parity rc=$?" >> $O/rc.txt
tail -1 $O/check.log; grep -E "PARITY|MISMATCH|FAIL" $O/parity6.txt | head
timeout 100 d/gpu_bench --dtypes nvfp4,fp8 > $O/bench_d.jsonl 2>/dev/null; echo "bench_d rc=$?" >> $O/rc.txt
timeout 100 e/gpu_bench --dtypes nvfp4,fp8 > $O/bench_e.jsonl 2>/dev/null; echo "bench_e rc=$?" >> $O/rc.txt
for i in 1 2; do
  timeout 100 d/e2e_decode --dtypes nvfp4 --batches 1,8 > $O/e2e_d_$i.jsonl 2>/dev/null; echo "d$i rc=$?" >> $O/rc.txt
  timeout 100 e/e2e_decode --dtypes nvfp4 --batches 1,8 > $O/e2e_e_$i.jsonl 2>/dev/null; echo "e$i rc=$?" >> $O/rc.txt
done
cat $O/rc.txt
for f in $O/e2e_*.jsonl; do echo $f; python3 -c "
import json
for l in open('$f'):
    d=json.loads(l)
    if d.get('bench')=='e2e_decode': print(d['batch'], round(d['tokens_per_s'],1), round(d['ms_per_step'],3), round(d.get('baseline_ms_per_step',0),3))
"; done
python3 - $O/bench_d.jsonl $O/bench_e.jsonl <<'PY'
import json,sys
def load(f):
    return {(d['dtype'],d['context'],d['batch']):d['ms'] for d in map(json.loads,open(f)) if d.get('bench')=='decode' and 'ms' in d}
a=load(sys.argv[1]);b=load(sys.argv[2])
for k in sorted(a):
    if k in b: print(k, round(a[k]*1000,1), round(b[k]*1000,1), f"{(b[k]/a[k]-1)*100:+.1f}%")
PY
