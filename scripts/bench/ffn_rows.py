"""How fast a resident dense FFN's matrices stream from DRAM at decode: a native conversion's
gate/up rows and down rows (down.bin, packed as `run` packs them: runtime/ffn.py's DenseFfn),
every layer's matrix multiplied by one random token in turn, grouped by matrix kind and dtype.
28 layers of the 1.5B are ~1 GB: beyond the caches, as in decode.

    python -m scripts.bench.ffn_rows MODEL [--threads 1,2] [--reps 5] [--tokens 1]

Prints, per thread count and kind (gate+up; down per dtype), GB/s of weight bytes and ms a
matrix: the median and the best of --reps sweeps over the layers.
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from flashllm.ffi import kernel
from flashllm.format.reader import open_flash
from flashllm.runtime.ffn import DenseFfn


def kinds(ffn: DenseFfn) -> dict:
    """kind name -> list of (matrix, bytes): the layers' gate/up matrices, their down per dtype"""
    out = defaultdict(list)
    for layer, (gu, down) in enumerate(zip(ffn.gate_up, ffn.down)):
        out["gate+up"].append((gu, gu.data.nbytes))
        out[f"down {ffn.down_dtypes[layer]}"].append((down, down.data.nbytes))
    return dict(out)


def sweep(mats: list, xs: dict, threads: int) -> float:
    """seconds to multiply every matrix of mats by its x once"""
    t = time.perf_counter()
    for w, _ in mats:
        kernel.matmul(w, xs[w.cols], None, threads)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=1)
    a = ap.parse_args()
    flash = open_flash(a.model)
    ffn = DenseFfn(flash, 1)
    if not ffn.rows:
        raise SystemExit(f"{a.model}: no down rows (down.bin): not a native conversion")
    rng = np.random.default_rng(0)
    groups = kinds(ffn)
    xs = {n: rng.standard_normal((a.tokens, n)).astype(np.float32)         # (T, cols)
          for n in {w.cols for mats in groups.values() for w, _ in mats}}
    for threads in [int(t) for t in a.threads.split(",")]:
        for name, mats in groups.items():
            sweep(mats, xs, threads)                                      # warm the code
            ts = np.array([sweep(mats, xs, threads) for _ in range(a.reps)])  # (reps,)
            nbytes = sum(b for _, b in mats)
            med, best = np.median(ts), ts.min()
            print(f"t={threads} {name:9s} x{len(mats)} {type(mats[0][0]).__name__}: "
                  f"{nbytes / med / 1e9:5.1f} GB/s median ({nbytes / best / 1e9:5.1f} best), "
                  f"{med / len(mats) * 1e3:.3f} ms a matrix")


if __name__ == "__main__":
    main()
