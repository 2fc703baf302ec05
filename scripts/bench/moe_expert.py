"""One OLMoE-shape Q4_0 expert's FFN in DRAM (d_model 2048, n_ff 1024, one token, hot): the bundle
kernel (kernel.ffn_bundles over (1024, 3456) q4_0 bundles, the `--dtype q4_0` conversion's) against
the expert's rows as a native conversion stores them (kernel.matmul of [gate; up], act_mul,
matmul of the down rows), unpacked and repacked (kernel.pack), and the cost of repacking in place.

Run:  python -m scripts.bench.moe_expert      (best of 5 × 20 calls each; random blocks)
"""
from __future__ import annotations

import time

import numpy as np

from flashllm.ffi import kernel
from flashllm.model.tensor import QTensor

D, N = 2048, 1024


def q4_0_rows(rng, rows: int, cols: int) -> np.ndarray:
    """(rows, cols / 32 · 18) uint8 random Q4_0 blocks, d = 1e-3."""
    b = rng.integers(0, 256, (rows, cols // 32, 18), dtype=np.uint8)
    b[..., :2] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    return b.reshape(rows, -1)


def best_ms(f, reps: int = 5, calls: int = 20) -> float:
    for _ in range(3):
        f()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e3


def main() -> None:
    rng = np.random.default_rng(0)
    gu = QTensor(q4_0_rows(rng, 2 * N, D), "q4_0", 2 * N, D)                # (2N, 1152)
    dn = QTensor(q4_0_rows(rng, D, N), "q4_0", D, N)                        # (D, 576)
    bundles = np.zeros((N, 3456), np.uint8)                                 # (N, stride)
    bundles[:, :1152], bundles[:, 1152:2304] = gu.data[:N], gu.data[N:]
    bundles[:, 2304:] = q4_0_rows(rng, N, D)
    packed = [kernel.pack(QTensor(w.data.copy(), "q4_0", w.rows, w.cols)) for w in (gu, dn)]
    h = rng.standard_normal((1, D)).astype(np.float32)                      # (1, D)

    def rows(g, d) -> None:
        z = kernel.matmul(g, h, None, 2)                                    # (1, 2N)
        kernel.matmul(d, kernel.act_mul("silu", z[:, :N], z[:, N:]), None, 2)

    def bundle() -> None:
        kernel.ffn_bundles(bundles, "q4_0", D, True, "silu", h, np.zeros((1, D), np.float32),
                           n_threads=2)

    print(f"bundles: {best_ms(bundle):.3f} ms an expert")
    print(f"rows: {best_ms(lambda: rows(gu, dn)):.3f} ms")
    if packed[0] is not None:
        print(f"rows packed: {best_ms(lambda: rows(*packed)):.3f} ms")
        copy = gu.data.copy()
        print(f"repack [gate; up] in place: "
              f"{best_ms(lambda: kernel.pack(QTensor(copy, 'q4_0', 2 * N, D), in_place=True), 5, 1):.3f} ms")


if __name__ == "__main__":
    main()
