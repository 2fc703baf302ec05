"""Weight-streaming speed of fl_matmul and fl_ffn_bundles against numpy f32 on the same work.

    python -m scripts.bench.kernels [--shapes 4864x896,151936x896] [--T 1]
        [--ffn 4864x896]

Decode (T = 1) is memory-bandwidth bound, so the figure of merit is weight bytes per second
(GMAC/s = multiply-adds per second, the figure for T > 1, e.g. --T 64 for prefill). numpy's row
is the same work on the f32 weight (its bytes count as f32; numpy uses its BLAS's own thread
count). q4_k (cols a multiple of 256, e.g. --shapes 8960x1536 --ffn 8960x1536) has no quantizer:
its rows are random Q4_K blocks of the same size (speed does not depend on the values), its FFN
bundles [q4_k gate | q4_k up | q4_1 down]. q4_0 / q4_1 / q8_0 / q4_k run twice: "int8" (activations quantized to int8, the default) and
"f32 x" (exact=True). The first line is this machine's DRAM read bandwidth as one numpy thread sees it
(a sum over 1 GiB), the ceiling for the T = 1 GB/s column.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from flashllm.ffi import kernel
from flashllm.ffi.quant import quantize_rows
from flashllm.model.tensor import QTensor, companion


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


def _rows(w: np.ndarray, dtype: str) -> np.ndarray:
    """w (rows, cols) f32 in dtype, (rows, row_bytes) uint8; q4_k: random Q4_K blocks."""
    if dtype != "q4_k":
        return quantize_rows(w, dtype)
    rows, nb = w.shape[0], w.shape[1] // 256
    blk = np.random.default_rng(2).integers(0, 256, (rows, nb, 144), dtype=np.uint8)
    scale = np.full((rows, nb, 2), 1e-3, np.float16)                     # d, dmin
    blk[..., :4] = scale.view(np.uint8).reshape(rows, nb, 4)
    return blk.reshape(rows, nb * 144)


def _dtypes(cols: int) -> tuple[str, ...]:
    return ("f32", "f16", "q8_0", "q4_0", "q4_1") + (("q4_k",) if cols % 256 == 0 else ())


def bench_shape(rows: int, cols: int, t: int, threads: list[int]) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((rows, cols), dtype=np.float32)  # (rows, cols)
    x = rng.standard_normal((t, cols), dtype=np.float32)  # (T, cols)
    print(f"\n{rows}x{cols}, T={t}")
    _row("what", "threads", "ms", "GB/s", "GMAC/s")
    macs = rows * cols * t
    sec = _best_seconds(lambda: x @ w.T)
    _row("numpy f32", "-", sec * 1e3, w.nbytes / sec / 1e9, macs / sec / 1e9)
    for dtype in _dtypes(cols):
        q = QTensor(_rows(w, dtype), dtype, rows, cols)
        for exact in (False, True) if dtype.startswith("q") else (True,):
            name = dtype + ("" if not dtype.startswith("q") else " f32 x" if exact else " int8")
            for n in threads:
                sec = _best_seconds(lambda: kernel.matmul(q, x, n_threads=n, exact=exact))
                _row(name, n, sec * 1e3, q.nbytes / sec / 1e9, macs / sec / 1e9)


def _row(*cells) -> None:
    fmt = [f"{c:<14}" if i == 0 else (f"{c:>9.3f}" if isinstance(c, float) else f"{c:>9}")
           for i, c in enumerate(cells)]
    print("".join(fmt))


def bench_ffn(n_ff: int, d: int, t: int, threads: list[int]) -> None:
    """A dense GLU FFN (every neuron a bundle) against numpy's three f32 matmuls."""
    rng = np.random.default_rng(1)
    gate, up, down = (rng.standard_normal((n_ff, d), dtype=np.float32) * 0.05 for _ in range(3))
    x = rng.standard_normal((t, d), dtype=np.float32)  # (T, d)
    print(f"\nffn_bundles GLU silu, {n_ff} neurons x d={d}, T={t}")
    _row("what", "threads", "ms", "GB/s", "GMAC/s")
    macs = 3 * n_ff * d * t

    def numpy_ffn():
        g = x @ gate.T  # (T, n_ff)
        return (g / (1 + np.exp(-g)) * (x @ up.T)) @ down  # (T, d)

    sec = _best_seconds(numpy_ffn)
    _row("numpy f32", "-", sec * 1e3, 3 * gate.nbytes / sec / 1e9, macs / sec / 1e9)
    for dtype in _dtypes(d):
        bundles = np.ascontiguousarray(np.concatenate(
            [_rows(gate, dtype), _rows(up, dtype), quantize_rows(down, companion(dtype))],
            axis=1))  # (n_ff, stride)
        for exact in (False, True) if dtype.startswith("q") else (True,):
            name = dtype + ("" if not dtype.startswith("q") else " f32 x" if exact else " int8")
            for n in threads:
                y = np.zeros((t, d), np.float32)  # (T, d)
                sec = _best_seconds(lambda: kernel.ffn_bundles(bundles, dtype, d, True, "silu", x,
                                                               y, n_threads=n, exact=exact))
                _row(name, n, sec * 1e3, bundles.nbytes / sec / 1e9, macs / sec / 1e9)


def dram_read_gbs() -> float:
    """GB/s of one numpy thread summing a 1 GiB float64 array (DRAM read, not cache)."""
    a = np.ones(1 << 27)  # (2**27,) 1 GiB
    sec = _best_seconds(lambda: float(a.sum()), budget=1.0, max_runs=5)
    return a.nbytes / sec / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4864x896,151936x896")
    ap.add_argument("--T", type=int, default=1, help="tokens per call")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--ffn", default="4864x896", help="n_ff x d of a bundled FFN ('' to skip)")
    args = ap.parse_args()
    threads = [int(n) for n in args.threads.split(",")]
    print(f"DRAM read, one numpy thread: {dram_read_gbs():.1f} GB/s")
    for shape in args.shapes.split(","):
        rows, cols = (int(v) for v in shape.split("x"))
        bench_shape(rows, cols, args.T, threads)
    if args.ffn:
        n_ff, d = (int(v) for v in args.ffn.split("x"))
        bench_ffn(n_ff, d, args.T, threads)


if __name__ == "__main__":
    main()
