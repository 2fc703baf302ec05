"""The FFN kernel on a real model's layers by tokens per call: what a decode pass with T - 1
draft guesses costs (the per-token path for T <= 10, GEMM panels beyond).

Run:  python -m scripts.bench.ffn_tokens [MODEL] [--tokens 1,2,3,4,5,6,8,9,12] [--threads 2]
      [--layers K] [--rows N] [--apart] [--real]
Every layer of MODEL (a converted folder; default the bench's calibrated Qwen2.5-Coder-1.5B q4_k)
is read into DRAM and cycled (28 layers of 23 MB: beyond the caches, as in decode; --layers K:
the first K only; --rows N: each layer's first N bundles, as a neuron cache's; --apart: gate / up
rows and down columns in two arrays, as a split cache holds them), x is random
(T, d_model) * 0.5 or, with --real, each layer's own FFN inputs of the dense model over the
built-in evaluation code (as many neurons pass the thresholds as in a run: random inputs let
fewer through, and skip their down columns), the layers' calibrated thresholds apply; each T
prints the best of 4 sweeps in ms per layer.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from flashllm.cli.app import cache_dir
from flashllm.ffi import kernel
from flashllm.format.reader import open_flash
from flashllm.generation.tokenizer import Tokenizer
from flashllm.runtime.ffn import DenseFfn
from flashllm.runtime.model import Model
from flashllm.sparsity.activations import manifest_thresholds
from flashllm.sparsity.calibrate import collect_ffn_inputs, text_tokens
from flashllm.sparsity.corpus import builtin_text

DEFAULT = Path("converted") / "qwen2.5-coder-1.5b-q4_k-cal"    # in the user cache: make bench's


SKIP = 8     # --real: the first positions' inputs are left out (a text's start is unlike decode)


def real_inputs(flash, n_layers: int, n_tokens: int, threads: int) -> list:
    """Per layer (n_tokens, d_model): the dense model's FFN inputs over the built-in evaluation
    code, past its first SKIP positions."""
    ids = text_tokens(Tokenizer.from_flash(flash), builtin_text("evaluation", "code").text,
                      n_tokens + SKIP)
    dense = Model(flash, n_threads=threads, n_ctx=len(ids), ffn=DenseFfn(flash, threads))
    return [np.ascontiguousarray(h[SKIP:]) for h in collect_ffn_inputs(dense, ids)[:n_layers]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, nargs="?", default=cache_dir() / DEFAULT)
    ap.add_argument("--tokens", default="1,2,3,4,5,6,8,9,12")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=0, help="cycle the first K layers (0: all)")
    ap.add_argument("--rows", type=int, default=0, help="each layer's first N bundles (0: all)")
    ap.add_argument("--apart", action="store_true", help="down columns apart (NeuronCache.split)")
    ap.add_argument("--real", action="store_true", help="real FFN inputs instead of random ones")
    args = ap.parse_args()
    flash = open_flash(args.model)
    cfg, f = flash.config, flash.ffn
    rows = args.rows or None
    layers = [np.ascontiguousarray(flash.read_ffn_layer(i)[:rows])         # (N, stride) each
              for i in range(args.layers or cfg.n_layers)]
    k = f.down_offset
    downs = [np.ascontiguousarray(b[:, k:]) if args.apart else None for b in layers]  # (N, tail)
    if args.apart:
        layers = [np.ascontiguousarray(b[:, :k]) for b in layers]         # (N, k) each
    thr = manifest_thresholds(flash.manifest, cfg.n_layers)
    ts = [int(t) for t in args.tokens.split(",")]
    if args.real:                                           # per layer (max T, d_model)
        xs = real_inputs(flash, len(layers), max(ts), args.threads)
    else:
        x = np.random.default_rng(0).standard_normal((64, cfg.d_model)).astype(np.float32) * 0.5
        xs = [x] * len(layers)                              # (64, d_model), every layer
    cells = []
    for T in ts:
        xts = [np.ascontiguousarray(x[:T]) for x in xs]     # per layer (T, d_model)
        y = np.zeros((T, cfg.d_model), np.float32)          # (T, d_model)
        best = float("inf")
        for _ in range(4):
            t0 = time.perf_counter()
            for i, bundles in enumerate(layers):
                kernel.ffn_bundles(bundles, f.dtype, cfg.d_model, cfg.glu, cfg.act, xts[i], y,
                                   threshold=thr[i], n_threads=args.threads,
                                   down_dtype=f.down_dtypes[i], down=downs[i])
            best = min(best, time.perf_counter() - t0)
        cells.append(f"T={T}: {1e3 * best / len(layers):.2f}")
    form = (", down apart" if args.apart else "") + (", real inputs" if args.real else "")
    print(f"{args.model.name}{form}, {args.threads} threads, ms per layer: " + "  ".join(cells))


if __name__ == "__main__":
    main()
