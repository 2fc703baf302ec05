"""fl_attention of one decode token over an f16 KV cache from DRAM: per layer µs and GB/s of keys
and values read, at a few positions, 1 and 2 threads (native/attend.c; docs/history, session 40).

Run:  python -m scripts.bench.attention [--kv-heads 16 --heads 16 --head-dim 128] [--layers 16]
      (OLMoE's shape by default; the 1.5B's: --kv-heads 2 --heads 12)
Each pass reads every layer's cache once after 64 MiB of other data has pushed them out of the
last-level cache; the best of --reps passes is shown.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from flashllm.ffi import kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--positions", default="128,192,512")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    pos = [int(p) for p in a.positions.split(",")]
    shape = (max(pos) + 1, a.kv_heads, a.head_dim)                       # (n_ctx, n_kv, hd)
    ks = [rng.standard_normal(shape).astype(np.float16) for _ in range(a.layers)]
    vs = [rng.standard_normal(shape).astype(np.float16) for _ in range(a.layers)]
    q = rng.standard_normal((1, a.heads, a.head_dim)).astype(np.float32)  # (1, heads, hd)
    other = np.ones(64 << 20, np.uint8)                                   # (64 MiB,)
    scale = 1.0 / np.sqrt(a.head_dim)
    for p in pos:
        for threads in (1, 2):
            best = float("inf")
            for _ in range(a.reps):
                other[::64] += 1                                          # the caches evicted
                t = time.perf_counter()
                for k, v in zip(ks, vs):
                    kernel.attention(q, k, v, p, scale, threads)
                best = min(best, (time.perf_counter() - t) / a.layers)
            nbytes = 2 * p * a.kv_heads * a.head_dim * 2
            print(f"position {p}, {threads} thread(s): {best * 1e6:.1f} µs a layer, "
                  f"{nbytes / best / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
