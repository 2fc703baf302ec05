"""Quality of oracle FFN sparsity on a real model: held-out perplexity, locality and skew.

Run:  python -m scripts.studies.sparsity MODEL [--tokens 2048]
          [--ctx 512] [--chunks 4] [--sparsities 0.3,0.5,0.6,0.7] [--threads 2] [--json OUT]
MODEL: a converted folder or a models.toml name (read only; nothing is written to it).

1. Thresholds per layer on calibration text (stdlib calibration modules, --tokens tokens) for
   |silu(g)·u| (glu_product) at each sparsity, and |silu(g)| (CATS) at 0.5.
2. Held-out perplexity (stdlib evaluation modules, llama.cpp's definition) of: dense; the C
   kernel dropping terms with |silu(g)·u| < threshold (DenseFfn(threshold=...)); a CATS mask
   (|silu(g)| < threshold dropped, computed per token, the kernel over the kept rows).
3. On the calibration activations: the fraction of neurons active in the union of the last k
   tokens (k = 2, 4) and the share of all activations on the hottest 20% of neurons.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from flashllm.format.reader import open_flash
from flashllm.sparsity.activations import activation, ffn_activations, ffn_weights, hot_share, threshold
from flashllm.sparsity.calibrate import collect_ffn_inputs, text_tokens
from flashllm.cli.app import cache_dir, registry_path
from flashllm.sparsity.corpus import builtin_text
from flashllm.runtime.ffn import DenseFfn
from flashllm.runtime.model import Model
from flashllm.generation.perplexity import bos_to_add, perplexity
from flashllm.ffi.quant import dequantize_rows
from flashllm.convert.resolve import resolve_model
from flashllm.model.tensor import companion, row_bytes
from flashllm.generation.tokenizer import Tokenizer


class GateMaskFfn:
    """CATS: a neuron is kept for a token when |act(gate·h)| ≥ the layer's threshold. Computed
    in numpy (f32 BLAS) from the dequantized bundle parts: x += (act(g)·u·keep) @ down."""

    def __init__(self, flash, weights: list, thresholds: list):
        self.weights, self.thresholds = weights, thresholds        # FfnWeights per layer
        pb, f = flash.ffn.part_bytes, flash.ffn
        dt = companion(f.dtype)                                   # q4_k bundles: down in q4_1
        db = row_bytes(dt, f.d_model)
        self.down = [dequantize_rows(flash.read_ffn_layer(l)[:, 2 * pb:2 * pb + db], dt, f.d_model)
                     for l in range(flash.config.n_layers)]      # each (n_ff, d_model)

    def __call__(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        w = self.weights[layer]
        g = activation(h @ w.gate.T, w.act)                       # (T, n_ff)
        a = g * (h @ w.up.T)                                      # (T, n_ff)
        a[np.abs(g) < self.thresholds[layer]] = 0.0
        x += a @ self.down[layer]                                 # (T, d_model)

    def stats(self) -> dict:
        return {"ffn": "cats"}


def union_fraction(mask: np.ndarray, k: int, chunk: int) -> float:
    """Mean fraction of neurons active in the union of the last k tokens (within each chunk)."""
    out = []
    for s in range(0, len(mask), chunk):
        m = mask[s:s + chunk]                                              # (T, n_ff)
        u = m[k - 1:].copy()
        for j in range(1, k):
            u |= m[k - 1 - j:len(m) - j]
        out.append(u.mean(axis=1))
    return float(np.concatenate(out).mean())


def layer_study(flash, inputs, sparsities, ctx, log):
    """Per-layer thresholds (glu_product per s, gate at 0.5), FFN weights, locality, skew."""
    th = {s: [] for s in sparsities}
    cats, weights, local = [], [], {s: {"union2": [], "union4": [], "hot20": []} for s in (0.5, 0.7)}
    for layer in range(len(inputs)):
        w = ffn_weights(flash, layer)
        prod = ffn_activations(flash, layer, inputs[layer], "glu_product", weights=w)   # (N, n_ff)
        gate = np.abs(activation(inputs[layer] @ w.gate.T, w.act))                      # (N, n_ff)
        inputs[layer] = None
        for s in sparsities:
            th[s].append(threshold(prod, s))
        cats.append(threshold(gate, 0.5))
        weights.append(w)
        for s in local:
            mask = prod >= threshold(prod, s)                                           # (N, n_ff)
            local[s]["union2"].append(union_fraction(mask, 2, ctx))
            local[s]["union4"].append(union_fraction(mask, 4, ctx))
            local[s]["hot20"].append(hot_share(mask.mean(0)))
        log(f"layer {layer}: thresholds {[round(th[s][-1], 4) for s in sparsities]}, cats {cats[-1]:.4f}")
    return th, cats, weights, {s: {k: float(np.mean(v)) for k, v in d.items()} for s, d in local.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--sparsities", default="0.3,0.5,0.6,0.7")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    log = lambda m: print(m, file=sys.stderr, flush=True)
    sparsities = [float(s) for s in args.sparsities.split(",")]
    flash = open_flash(resolve_model(args.model, cache_dir(), registry_path(), log))
    tok = Tokenizer.from_flash(flash)
    cal_text = builtin_text("calibration", "code", 8 * args.tokens)
    cal = text_tokens(tok, cal_text.text, args.tokens)
    t0 = time.perf_counter()
    inputs = collect_ffn_inputs(Model(flash, n_threads=args.threads, n_ctx=args.ctx), cal, n_ctx=args.ctx)
    th, cats, weights, local = layer_study(flash, inputs, sparsities, args.ctx, log)
    log(f"calibration: {time.perf_counter() - t0:.0f} s")
    ev_text = builtin_text("evaluation", "code")
    ev = text_tokens(tok, ev_text.text)
    dense = DenseFfn(flash, args.threads)
    net = Model(flash, n_threads=args.threads, n_ctx=args.ctx, ffn=dense)
    bos = bos_to_add(tok, flash.config.bos_token_id)
    rows = []
    settings = [("dense", None, dense)] + [(f"glu_product s={s}", th[s], dense) for s in sparsities] \
        + [("cats |silu(g)| s=0.5", cats, GateMaskFfn(flash, weights, cats))]
    for name, thresholds, ffn in settings:
        dense.threshold = thresholds if ffn is dense and thresholds else [0.0] * flash.config.n_layers
        net.ffn = ffn
        r = perplexity(net, ev, args.ctx, args.chunks, bos)
        rows.append({"setting": name, "ppl": r.ppl, "ppl_err": r.ppl_err, "count": r.count,
                     "ratio": r.ppl / rows[0]["ppl"] if rows else 1.0, "seconds": r.seconds})
        log(f"{name}: PPL {r.ppl:.4f} +/- {r.ppl_err:.4f} (x{rows[-1]['ratio']:.3f}), {r.seconds:.0f} s")
    out = {"model": str(flash.path), "dtype": flash.dtype, "calibration": {**cal_text.description,
           "n_tokens": len(cal)}, "evaluation": {**ev_text.description, "n_ctx": args.ctx,
           "n_chunks": args.chunks}, "perplexity": rows, "locality": local,
           "thresholds": {str(s): th[s] for s in sparsities}, "cats_thresholds": cats}
    print(json.dumps({k: out[k] for k in ("model", "perplexity", "locality")}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
