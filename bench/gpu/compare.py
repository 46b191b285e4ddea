#!/usr/bin/env python3
"""Summaries of the GPU benchmarks' JSON lines, for comparing builds run in one call.

  compare.py e2e FILE...          batch, tok/s, ms/step at the context, ms/step at context 16,
                                  one line per e2e_decode row of each file
  compare.py decode BEFORE AFTER  per decode shape (dtype, context, batch) of two gpu_bench
                                  outputs: us per call in each and the change
"""
import json
import sys


def rows(path, bench):
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                d = json.loads(line)
                if d.get("bench") == bench:
                    yield d


def e2e(paths):
    for path in paths:
        print(path)
        for d in rows(path, "e2e_decode"):
            if "tokens_per_s" not in d:
                print(f"  {d.get('dtype')} batch {d.get('batch')}: {d.get('skipped', 'no result')}")
                continue
            print(
                f"  {d['dtype']} batch {d['batch']}: {d['tokens_per_s']:.1f} tok/s, "
                f"{d['ms_per_step']:.3f} ms/step, context 16: {d.get('baseline_ms_per_step', 0):.3f}"
            )


def decode(before, after):
    def times(path):
        return {(d["dtype"], d["context"], d["batch"]): d["ms"] for d in rows(path, "decode") if "ms" in d}

    a, b = times(before), times(after)
    for key in sorted(a):
        if key in b:
            print(f"{key}: {a[key] * 1e3:.1f} -> {b[key] * 1e3:.1f} us ({(b[key] / a[key] - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "e2e":
        e2e(sys.argv[2:])
    elif len(sys.argv) == 4 and sys.argv[1] == "decode":
        decode(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
