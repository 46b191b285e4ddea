"""Peer baseline for docs/BENCHMARKS.md's "Prefill and extend attention": torch's BF16
scaled_dot_product_attention on the FLASH_ATTENTION backend, causal, on `gpu_bench --prefill`'s
shapes (32 query heads, 8 KV heads, head dim 128): prompts of 4K, 16K and 32K tokens, 1,024
queries after a 31,744-token prefix, and a long prompt's 256-query extend blocks. One JSON object
per line.

Prompts use is_causal with grouped-query K/V; extends (queries after a prefix) use
`causal_lower_right` on K/V repeated to the query heads (the flash backend's form for a causal
mask whose diagonal ends at the last key). FLOPs count 4 x heads x head dim per visible
(query, key) pair, as gpu_bench does. CUDA events around each call after 3 warm-ups, median of
15 (`ms`), and around 5 calls queued back to back, per call, median of 9 (`queued_ms`). Run:
python3 bench/gpu/torch_prefill.py
"""

import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

Q_HEADS, KV_HEADS, DIM = 32, 8, 128
SHAPES = [(0, 4096), (0, 16384), (0, 32768), (31744, 1024), (4096, 256), (16128, 256), (32512, 256)]


def median_ms(fn, warmup=3, runs=15, reps=1):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    times.sort()
    return times[len(times) // 2]


def main():
    torch.manual_seed(0)
    for start, n in SHAPES:
        q = torch.randn(1, Q_HEADS, n, DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, KV_HEADS, start + n, DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            if start == 0:
                fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                group = Q_HEADS // KV_HEADS
                kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
                mask = causal_lower_right(n, start + n)
                fn = lambda: F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
            ms = median_ms(fn)
            queued = median_ms(fn, runs=9, reps=5)
        pairs = n * start + n * (n + 1) // 2
        print(json.dumps({"bench": "torch_prefill", "start": start, "rows": n, "ms": ms,
                          "queued_ms": queued,
                          "tflops": 4 * Q_HEADS * DIM * pairs / (ms * 1e9),
                          "torch": torch.__version__, "device": torch.cuda.get_device_name()}),
              flush=True)


if __name__ == "__main__":
    main()
