#!/usr/bin/env bash
# Run 123b (H200): the decode table (graphs off and on), and where a batch-1 step's time goes (ncu).
set -u
OUT=${OUT:-/tmp/out}; root=$(pwd); R=$OUT/raw; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv,noheader | tee $R/device.txt
t0=$(date +%s); el() { echo "t=$(( $(date +%s)-t0 ))"; }
B=/tmp/bin; mkdir -p $B && cp $root/.gpuc11/old5/*.xz $B/ && cd $B && xz -dkf *.xz 2>/dev/null; chmod +x $B/*; cd $B; el
sum() { python3 -c '
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l)
    if r.get("bench")=="e2e_decode" and "tokens_per_s" in r: print(r["dtype"],r["batch"],r["context"],r.get("graphs"),"%.1f"%r["tokens_per_s"],"%.2f"%r["ms_per_step"],"base %.2f"%(r["baseline_ms_per_step"] or 0))
    elif r.get("bench")=="e2e_decode_graphs" and "speedup" in r: print("graphs",r["dtype"],r["batch"],r["tokens_identical"],"%.3f"%r["speedup"])
    elif "skipped" in r: print(r["dtype"],r["batch"],"skip")
' $1; }
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); echo "ncu: $NCU"
timeout 200 $NCU --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --print-units base \
  ./e2e_decode --dtypes nvfp4 --batches 1 --context 4096 --warmup 1 --steps 2 --no-baseline > $R/ncu_b1.csv 2>$R/ncu_b1.err; el
python3 - $R/ncu_b1.csv <<'PY' | tee $R/ncu_b1_summary.txt
import csv,sys,collections
rows=[r for r in csv.reader(open(sys.argv[1])) if len(r)>10]
h=rows[0]; rows=rows[1:]
iid=h.index("ID"); ik=h.index("Kernel Name"); im=h.index("Metric Name"); iv=h.index("Metric Value")
k={}
for r in rows:
    d=k.setdefault(int(r[iid]),{"name":r[ik]})
    try: d[r[im]]=float(r[iv].replace(",",""))
    except: pass
ids=sorted(k); print("kernels", len(ids))
# the last step: from after the second-to-last argmax-like kernel
names=[k[i]["name"] for i in ids]
marks=[j for j,n in enumerate(names) if "argmax" in n.lower()]
print("argmax marks", marks[-4:])
start = marks[-2]+1 if len(marks)>=2 else max(0,len(ids)-400)
step=[k[i] for i in ids[start:]]
tot=sum(d.get("gpu__time_duration.sum",0) for d in step)/1e3
print("last step: %d kernels, %.1f us kernel time"%(len(step),tot))
agg=collections.OrderedDict()
for d in step:
    n=d["name"][:90]; a=agg.setdefault(n,[0,0.0,0.0]); a[0]+=1; a[1]+=d.get("gpu__time_duration.sum",0)/1e3; a[2]+=d.get("dram__bytes_read.sum",0)
for n,(c,t,b) in sorted(agg.items(), key=lambda x:-x[1][1]):
    print("%5d %9.1f us %7.2f us/call %7.0f GB/s  %s"%(c,t,t/c,b/(t*1e3) if t else 0,n))
PY
el
cd $OUT && tar czf raw.tgz raw && rm -rf raw; ls -la $OUT
