"""Weight-streaming speed of fl_matmul (GB/s of weight bytes read) against numpy f32 matmul.

    PYTHONPATH=. python scripts/bench_kernels.py [--shapes 4864x896,151936x896] [--T 1]

Decode (T = 1) is memory-bandwidth bound, so the figure of merit is weight bytes per second.
numpy's row is the same work on the f32 weight (its bytes count as f32).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from flashllm import kernel
from flashllm.quant import quantize_rows
from flashllm.tensor import QTensor


def _best_seconds(fn, budget: float = 0.6, max_runs: int = 200) -> float:
    """The fastest of repeated calls of fn within about budget seconds."""
    fn()
    best, spent, runs = float("inf"), 0.0, 0
    while spent < budget and runs < max_runs:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, runs = min(best, dt), spent + dt, runs + 1
    return best


def bench_shape(rows: int, cols: int, t: int, threads: list[int]) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((rows, cols), dtype=np.float32)  # (rows, cols)
    x = rng.standard_normal((t, cols), dtype=np.float32)  # (T, cols)
    print(f"\n{rows}x{cols}, T={t}")
    print(f"{'what':<14}{'threads':>8}{'ms':>10}{'GB/s':>8}")
    sec = _best_seconds(lambda: x @ w.T)
    print(f"{'numpy f32':<14}{'-':>8}{sec * 1e3:>10.3f}{w.nbytes / sec / 1e9:>8.2f}")
    for dtype in ("f32", "f16", "q8_0", "q4_0"):
        q = QTensor(quantize_rows(w, dtype), dtype, rows, cols)
        for n in threads:
            sec = _best_seconds(lambda: kernel.matmul(q, x, n_threads=n))
            print(f"{dtype:<14}{n:>8}{sec * 1e3:>10.3f}{q.nbytes / sec / 1e9:>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4864x896,151936x896")
    ap.add_argument("--T", type=int, default=1, help="tokens per call")
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    threads = [int(n) for n in args.threads.split(",")]
    for shape in args.shapes.split(","):
        rows, cols = (int(v) for v in shape.split("x"))
        bench_shape(rows, cols, args.T, threads)


if __name__ == "__main__":
    main()
