#!/usr/bin/env bash
# Two GPUs, real processes: etcd, a prefill worker on GPU 0, a decode worker on GPU 1 (both
# --device cuda, NVFP4 KV), a router that disaggregates every prompt (--local-prefill-threshold 0);
# three long prompts through the router (greedy), then each worker's transfer counters and NCCL
# pair set-ups (trigger="ahead": set up when the decode worker registered; trigger="request": a
# request paid for it, which should not happen) and staging-pool gauges. Run on a 2-GPU
# machine: NIBBLE=path/to/nibble ETCD=path/to/etcd MODEL=model.gguf OUT=dir bash nccl_cluster.sh
set -u
NIBBLE=${NIBBLE:-target/release/nibble}
ETCD=${ETCD:-etcd}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-/tmp/nccl-cluster}
TRANSFER=${TRANSFER:-auto}  # the workers' --kv-transfer: auto (NCCL here) or grpc
mkdir -p "$OUT"
DATA=$(mktemp -d)
E=http://127.0.0.1:23790
"$ETCD" --data-dir "$DATA/etcd" --listen-client-urls $E --advertise-client-urls $E \
    --listen-peer-urls http://127.0.0.1:23800 > "$OUT/etcd.log" 2>&1 &
PIDS=$!
sleep 2
for role in prefill decode; do
    gpu=0; port=7101; mport=9101
    if [[ $role == decode ]]; then gpu=1; port=7102; mport=9102; fi
    CUDA_VISIBLE_DEVICES=$gpu "$NIBBLE" "$role" --model "$MODEL" --device cuda --kv-dtype nvfp4 \
        --listen 127.0.0.1:$port --etcd-endpoints $E --metrics-listen 127.0.0.1:$mport \
        --kv-transfer "$TRANSFER" \
        > "$OUT/$role.log" 2>&1 &
    PIDS="$PIDS $!"
done
"$NIBBLE" router --model "$MODEL" --listen 127.0.0.1:7100 --etcd-endpoints $E \
    --local-prefill-threshold 0 --metrics-listen 127.0.0.1:9100 --no-http > "$OUT/router.log" 2>&1 &
PIDS="$PIDS $!"
sleep 12
PROMPT=$(python3 -c "print(' '.join(['The history of the city of London is long and full of change.'] * 50))")
for i in 1 2 3; do
    "$NIBBLE" generate --url 127.0.0.1:7100 --max-tokens 32 --temperature 0 "$PROMPT Question $i: what is this text about?"
    echo "exit $?"
done > "$OUT/generate.txt" 2>&1
for p in 9101 9102; do
    python3 -c "import urllib.request,sys; print(urllib.request.urlopen('http://127.0.0.1:$p/metrics').read().decode())" \
        | grep -E "transfer|fallback|nccl" > "$OUT/metrics-$p.txt"
done
kill -INT $PIDS 2>/dev/null
sleep 3
rm -rf "$DATA"
cat "$OUT/generate.txt" "$OUT/metrics-9101.txt" "$OUT/metrics-9102.txt"
grep -h -i "nccl" "$OUT"/prefill.log "$OUT"/decode.log | head -20
