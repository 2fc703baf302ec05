"""How fast the resident-weight matmul reads a dtype's weights: random quantized matrices, packed
as `run` packs them (kernel.pack), multiplied by one token in turn, 1 and 2 threads. With enough
matrices to exceed the last-level cache the figure is the kernel from DRAM; one small matrix,
repeated, is its arithmetic alone (docs/MEASUREMENTS.md).

    python -m scripts.bench.packed_rates q4_k 17920 1536 --count 28     # the 1.5B's gate/up
    python -m scripts.bench.packed_rates q5_0 9728 896 --count 24       # the 0.5B's gate/up
    python -m scripts.bench.packed_rates q8_0 151936 896                # the 0.5B's head
    python -m scripts.bench.packed_rates q2_k 17920 1536 --count 28     # a Q2_K 1.5B's gate/up

Prints GB/s of weight bytes (best of --reps passes over all matrices) per thread count; --tokens
multiplies each matrix by T tokens a call (a prefill's product).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from flashllm.ffi import kernel
from flashllm.model.tensor import QTensor, row_bytes

# (block bytes, offset of its f16 scale, scale) per dtype: random bytes with a small scale keep
# the sums finite (a random f16 d may be inf or NaN)
SCALES = {"q4_k": (144, 0, [0.01, 0.001]), "q6_k": (210, 208, [0.01]),
          "q5_k": (176, 0, [0.01, 0.001]), "q2_k": (84, 80, [0.01, 0.001]),
          "q3_k": (110, 108, [0.01]), "q8_0": (34, 0, [0.01]), "q5_0": (22, 0, [0.01])}


def random_matrix(rng, dtype: str, rows: int, cols: int):
    """A (rows, cols) matrix of random blocks, packed where this build has a layout for it."""
    raw = rng.integers(0, 256, size=rows * row_bytes(dtype, cols), dtype=np.uint8)  # (bytes,)
    block, at, scale = SCALES[dtype]
    d = np.frombuffer(np.array(scale, np.float16).tobytes(), np.uint8)
    raw.reshape(-1, block)[:, at:at + len(d)] = d
    w = QTensor(raw.reshape(rows, -1), dtype, rows, cols)
    return kernel.pack(w, in_place=False) or w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dtype", choices=sorted(SCALES))
    ap.add_argument("rows", type=int)
    ap.add_argument("cols", type=int)
    ap.add_argument("--count", type=int, default=1, help="distinct matrices, cycled")
    ap.add_argument("--repeat", type=int, default=1, help="calls per matrix in a pass")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=1, help="tokens a call (prefill: 64)")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    ws = [random_matrix(rng, a.dtype, a.rows, a.cols) for _ in range(a.count)]
    x = rng.standard_normal((a.tokens, a.cols)).astype(np.float32)        # (T, cols)
    nbytes = a.count * a.repeat * a.rows * row_bytes(a.dtype, a.cols)
    print(f"{a.dtype} {a.rows}x{a.cols} x{a.count}, T = {a.tokens}, {type(ws[0]).__name__}")
    for threads in (1, 2):
        best = float("inf")
        for _ in range(a.reps + 1):                                       # the first warms
            t = time.perf_counter()
            for w in ws:
                for _ in range(a.repeat):
                    kernel.matmul(w, x, None, threads)
            best = min(best, time.perf_counter() - t)
        print(f"  {threads} thread(s): {nbytes / best / 1e9:.1f} GB/s, "
              f"{best / (a.count * a.repeat) * 1e3:.3f} ms a matrix")


if __name__ == "__main__":
    main()
