"""An unpacked quantized matrix product by tokens per call: what a streamed (unpacked) weight
costs a pass over T tokens (a prompt-lookup draft's guesses through streamed attention).

Run:  python -m scripts.bench.matmul_tokens [--dtype q4_k] [--rows 8960] [--cols 1536]
      [--tokens 1,2,3,4] [--threads 2]
A random (rows, cols) matrix quantized by the kernel's own quantizer, random x (T, cols); each T
prints the best of 5 sweeps of 10 calls, in ms a call.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from flashllm.ffi import kernel
from flashllm.ffi.quant import quantize_rows
from flashllm.model.tensor import QTensor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="q4_k")
    ap.add_argument("--rows", type=int, default=8960)
    ap.add_argument("--cols", type=int, default=1536)
    ap.add_argument("--tokens", default="1,2,3,4")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((a.rows, a.cols)).astype(np.float32)          # (rows, cols)
    q = QTensor(quantize_rows(w, a.dtype), a.dtype, a.rows, a.cols)
    cells = []
    for T in (int(t) for t in a.tokens.split(",")):
        x = rng.standard_normal((T, a.cols)).astype(np.float32)           # (T, cols)
        for _ in range(3):
            kernel.matmul(q, x, None, a.threads)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(10):
                kernel.matmul(q, x, None, a.threads)
            best = min(best, (time.perf_counter() - t0) / 10)
        cells.append(f"T={T}: {1e3 * best:.2f}")
    print(f"{a.dtype} ({a.rows}, {a.cols}), {a.threads} threads, ms a call: " + "  ".join(cells))


if __name__ == "__main__":
    main()
