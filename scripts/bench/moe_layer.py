"""A mixture of experts' decode layer (fl_moe_ffn, one token, random top-8 of 64 OLMoE-shape Q4_0
experts on huge pages) against packed matmuls of the same shapes and bytes, all from DRAM.

Each call reads 8 experts' [gate; up] (2 n_ff, d) and down (d, n_ff) rows: 28.3 MB. The
references are fl_matmul_packed on an (8 n_ff, d) matrix (half the [gate; up] bytes: twice that
is the gate / up side) and an (8 d, n_ff) one (the down side), i.e. the
same bytes in 2048- and 1024-value rows, called in turn over enough copies (--copies, default 32:
300 MB a shape) that no call finds its matrix in the last-level cache (8 copies of 9.4 MB leave
some of it in a 32 MB L3 and read faster than DRAM allows). So `moe / (2 x gate_up + down)` is the
layer's overhead over its own matmuls: scratch, the single-threaded phases, an expert's start.

Run:  python -m scripts.bench.moe_layer [--threads 2] [--layers 2] [--calls 300] [--copies 32]
      (under `chrt -f 1` on a shared machine; prints the median ms a call and GB/s)
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from flashllm.ffi import kernel, moe as moe_kernel
from flashllm.model.tensor import QTensor
from flashllm.runtime.moe import on_huge_pages

D, N, E, K = 2048, 1024, 64, 8


def q4_0(rng, rows: int, cols: int) -> QTensor:
    """(rows, cols) random Q4_0 rows, every block's d = 1e-3."""
    b = rng.integers(0, 256, (rows, cols // 32, 18), dtype=np.uint8)     # (rows, blocks, 18)
    b[..., :2] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    return QTensor(b.reshape(rows, -1), "q4_0", rows, cols)


def median_ms(f, calls: int) -> float:
    """median wall ms of f(i) over calls calls (after calls // 10 unmeasured ones)."""
    for i in range(calls // 10):
        f(i)
    t = []
    for i in range(calls):
        t0 = time.perf_counter()
        f(i)
        t.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(t))


def moe_ms(rng, layers: int, calls: int, threads: int) -> float:
    sets = []
    for _ in range(layers):
        experts = [(kernel.pack(q4_0(rng, 2 * N, D)), kernel.pack(q4_0(rng, D, N)))
                   for _ in range(E)]
        sets.append(moe_kernel.ExpertSet(on_huge_pages(experts), "silu"))
    h = rng.standard_normal((1, D)).astype(np.float32)                   # (1, D)
    x = np.zeros((1, D), np.float32)                                     # (1, D)
    ids = [np.sort(rng.permutation(E)[:K]).astype(np.int32)[None] for _ in range(calls)]  # (1, K)
    w = np.full((1, K), 1 / K, np.float32)                               # (1, K)
    return median_ms(lambda i: sets[i % layers](ids[i % calls], w, h, x, False, threads), calls)


def matmul_ms(rng, rows: int, cols: int, copies: int, calls: int, threads: int) -> float:
    mats = [m for (m,) in on_huge_pages([(kernel.pack(q4_0(rng, rows, cols)),)
                                         for _ in range(copies)])]
    h = rng.standard_normal((1, cols)).astype(np.float32)                # (1, cols)
    return median_ms(lambda i: kernel.matmul(mats[i % copies], h, None, threads), calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2, help="expert sets called in turn (226 MB each)")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--copies", type=int, default=32)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    if kernel.packed_nbytes("q4_0", D, N) == 0:
        raise SystemExit("moe_layer: this build has no packed q4_0 layout")
    layer_mb = K * 3 * N * D * 18 / 32 / 1e6
    moe = moe_ms(rng, args.layers, args.calls, args.threads)
    gu = matmul_ms(rng, K * N, D, args.copies, args.calls, args.threads)
    dn = matmul_ms(rng, K * D, N, args.copies, args.calls, args.threads)
    print(f"fl_moe_ffn, 8 experts ({layer_mb:.1f} MB): {moe:.3f} ms ({layer_mb / moe:.1f} GB/s)")
    for name, ms, rows, cols in (("gate_up half", gu, K * N, D), ("down", dn, K * D, N)):
        mb = rows * cols * 18 / 32 / 1e6
        print(f"matmul {rows}x{cols} ({name}, {mb:.1f} MB): {ms:.3f} ms ({mb / ms:.1f} GB/s)")
    print(f"moe / (2 x gate_up half + down) = {moe / (2 * gu + dn):.3f}")


if __name__ == "__main__":
    main()
