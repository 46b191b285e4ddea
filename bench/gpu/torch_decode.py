"""Peer baseline for docs/BENCHMARKS.md's CUDA section: torch's BF16 scaled_dot_product_attention
for one decode token (32 query heads, 8 KV heads, head dim 128, contiguous K/V), on the shapes of
`gpu_bench`, plus torch's device-to-device copy bandwidth. One JSON object per line.

Random inputs; small shapes rotate over several K/V copies so repeated runs do not read from L2;
CUDA events around 5 calls queued back to back after warm-up (and, as `isolated_ms`, around one
call alone); median per call. Run: python3 bench/gpu/torch_decode.py
"""

import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

Q_HEADS, KV_HEADS, DIM = 32, 8, 128
BATCHES = [1, 8, 32, 64, 128]
CONTEXTS = [4096, 32768, 131072]
L2_SAFE = 512 << 20  # rotate copies until one pass reads this many bytes
REPS = 5  # decode calls per timed sample, back to back


def emit(obj):
    print(json.dumps(obj), flush=True)


def time_calls(fn, warmup=3, min_runs=10, max_runs=200, budget_ms=400.0, reps=1):
    """Sorted per-call times (ms); each sample is `reps` calls back to back between one pair of
    events, divided by `reps` (gpu_bench times decode the same way)."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    times, spent = [], 0.0
    while len(times) < min_runs or (len(times) < max_runs and spent < budget_ms):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for r in range(reps):
            fn(warmup + len(times) * reps + r)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / reps
        spent += ms
        times.append(ms)
    times.sort()
    return times


def main():
    dev = torch.device("cuda")
    emit({"bench": "torch", "version": torch.__version__, "device": torch.cuda.get_device_name()})
    n = 4 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = time_calls(lambda i: dst.copy_(src), min_runs=20, max_runs=20)
    emit({"bench": "torch_copy", "bytes_each_way": n, "ms": t[len(t) // 2],
          "gbps": 2 * n / (t[len(t) // 2] * 1e6)})
    del src, dst
    torch.cuda.empty_cache()
    quick = "--quick" in sys.argv
    for ctx in CONTEXTS:
        for batch in BATCHES:
            if quick and (batch > 8 or ctx > 32768):
                continue
            row = {"bench": "torch_sdpa_decode", "dtype": "bf16", "batch": batch, "context": ctx}
            kv_bytes = 2 * batch * KV_HEADS * ctx * DIM * 2
            copies = max(1, min(4, L2_SAFE // kv_bytes + 1))
            try:
                q = torch.randn(batch, Q_HEADS, 1, DIM, dtype=torch.bfloat16, device=dev)
                kvs = [(torch.randn(batch, KV_HEADS, ctx, DIM, dtype=torch.bfloat16, device=dev),
                        torch.randn(batch, KV_HEADS, ctx, DIM, dtype=torch.bfloat16, device=dev))
                       for _ in range(copies)]
                used = None
                for name, backend in [("flash", SDPBackend.FLASH_ATTENTION),
                                      ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                                      ("cudnn", SDPBackend.CUDNN_ATTENTION),
                                      ("math", SDPBackend.MATH)]:
                    try:
                        with sdpa_kernel([backend]):
                            F.scaled_dot_product_attention(q, kvs[0][0], kvs[0][1], enable_gqa=True)
                        torch.cuda.synchronize()
                        used = (name, backend)
                        break
                    except RuntimeError:
                        continue
                if used is None:
                    raise RuntimeError("no SDPA backend accepted the shape")

                def call(i, backend=used[1]):
                    k, v = kvs[i % copies]
                    with sdpa_kernel([backend]):
                        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

                t = time_calls(call, reps=REPS)
                ms = t[len(t) // 2]
                alone = time_calls(call, warmup=0, min_runs=5, max_runs=50, budget_ms=100.0)
                row.update({"backend": used[0], "ms": ms, "min_ms": t[0], "runs": len(t),
                            "reps": REPS, "isolated_ms": alone[len(alone) // 2],
                            "copies": copies, "kv_bytes": kv_bytes,
                            "gbps": kv_bytes / (ms * 1e6)})
            except torch.cuda.OutOfMemoryError as e:
                row["skipped"] = f"out of memory: {str(e).splitlines()[0]}"
            emit(row)
            q = kvs = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
