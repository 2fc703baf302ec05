"""Predictor study: candidates compared by perplexity at equal bytes loaded (docs/PREDICTOR.md;
the question: docs/DESIGN.md, "Sparsity of today's models").

For a model (models.toml name or converted folder): run the dense model over calibration text and
record each layer's FFN input h; the true mask of a layer is |act(g)·u| >= t_l with t_l set for
--sparsity. Every candidate predictor is fitted on the calibration tokens, then for each load
(share of slots predicted per token) its per-layer thresholds are set on calibration scores and
held-out perplexity is measured with the FFN computing only the predicted slots, further
filtered by t_l. Also: recall/precision on held-out calibration tokens, predictor DRAM bytes,
predict time per token.

    python -m scripts.studies.predictor qwen2.5-coder-0.5b --calib-tokens 2048 --eval-tokens 1024
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from flashllm.ffi import kernel
from flashllm.format.reader import open_flash
from flashllm.sparsity.activations import default_criterion, ffn_activations, layer_thresholds
from flashllm.sparsity.calibrate import collect_ffn_inputs
from flashllm.cli.app import cache_dir, registry_path
from flashllm.sparsity.corpus import builtin_text
from flashllm.runtime.ffn import DenseFfn
from flashllm.runtime.model import Model
from flashllm.generation.perplexity import bos_to_add, perplexity
from flashllm.sparsity.train import mask_metrics, train_predictor
from flashllm.convert.resolve import resolve_model
from flashllm.generation.tokenizer import Tokenizer
from scripts.studies.predictor_sketches import SKETCHES, StaticHot, sketch_predictor

# name -> (kind, train_predictor keyword arguments)
CANDIDATES = {
    "lowrank-svd": ("lowrank", {"rank": 128, "dtype": "q8_0", "epochs": 0}),
    "lowrank": ("lowrank", {"rank": 128, "dtype": "q8_0", "epochs": 4}),
    "lowrank-pin16": ("lowrank", {"rank": 128, "dtype": "q8_0", "epochs": 4, "pin": 16}),
    "gate-q8": ("gate", {"dtype": "q8_0"}),
    "gate-q4": ("gate", {"dtype": "q4_0"}),
    "gate_up-q4": ("gate_up", {"dtype": "q4_0"}),
    "gate_lrup-q4": ("gate_lrup", {"rank": 128, "dtype": "q4_0"}),
    "lr_gate_up-r128": ("lr_gate_up", {"rank": 128}),
    "lr_gate_up-r256": ("lr_gate_up", {"rank": 256}),
    **{f"gate_up-{q}": ("sketch", {"quant": q}) for q in SKETCHES},    # simulated low-bit
    "static": ("static", {}),                                        # most frequent slots
}


class SparseEval:
    """FFN strategy: per token only the predicted slots (all slots without a predictor), each
    term dropped below the layer's activation threshold."""

    def __init__(self, dense: DenseFfn, act_th, predictor=None, thresholds=None):
        self.d, self.act_th, self.pred, self.th = dense, act_th, predictor, thresholds
        self.loaded, self.tokens = 0, 0

    def __call__(self, layer, h, x):
        d = self.d
        if self.pred is None:
            kernel.ffn_bundles(d.bundles[layer], d.dtype, d.d, d.glu, d.act, h, x, ids=d.ids[layer],
                               up_bias=d.up_b[layer], threshold=self.act_th[layer],
                               down_dtype=d.down_dtypes[layer])
            return
        hit = self.pred.score(layer, h) >= self.th[layer]                # (T, n_ff) bool
        for t in range(len(h)):
            rows = np.flatnonzero(hit[t]).astype(np.int32)               # (m,)
            self.loaded, self.tokens = self.loaded + rows.size, self.tokens + 1
            kernel.ffn_bundles(d.bundles[layer], d.dtype, d.d, d.glu, d.act, h[t:t + 1],
                               x[t:t + 1], ids=d.ids[layer], up_bias=d.up_b[layer], rows=rows,
                               threshold=self.act_th[layer], down_dtype=d.down_dtypes[layer])

    def stats(self):
        return {"ffn": "sparse-eval"}


class Curves:
    """Per layer, load and recall of a predictor's score at a grid of thresholds (calibration)."""

    GRID = np.linspace(0.02, 1.0, 99)                                     # loads

    def __init__(self, pred, hs, masks):
        self.th, self.rec = [], []
        for layer, (h, m) in enumerate(zip(hs, masks)):
            s = pred.score(layer, h)                                      # (N, n_ff)
            th = np.quantile(s, 1.0 - self.GRID)                          # (99,) per load
            pos = np.sort(s[m])                                           # (k,)
            self.th.append(th)
            self.rec.append(1.0 - np.searchsorted(pos, th) / max(pos.size, 1))  # (99,)

    def equal_load(self, load: float) -> list:
        i = int(np.argmin(np.abs(self.GRID - load)))
        return [float(t[i]) for t in self.th]

    def equal_recall(self, load: float) -> list:
        """One recall target for every layer, the highest whose mean load is <= load."""
        lo, hi = 0.0, 1.0
        for _ in range(30):
            mid = (lo + hi) / 2
            idx = [int(np.argmax(r >= mid)) for r in self.rec]            # first grid load
            lo, hi = (mid, hi) if np.mean(self.GRID[idx]) <= load else (lo, mid)
        idx = [int(np.argmax(r >= lo)) for r in self.rec]
        return [float(t[i]) for t, i in zip(self.th, idx)]


def eval_ppl(model, tokens, args) -> float:
    return perplexity(model, tokens, args.n_ctx, bos_id=args.bos).ppl


def held_out_metrics(pred, thresholds, hs, masks) -> dict:
    per = [mask_metrics(pred.score(l, h) >= t, m) for l, (h, m, t) in
           enumerate(zip(hs, masks, thresholds))]
    return {k: [round(p[k], 4) for p in per] for k in ("recall", "precision", "load")}


def predict_ms(pred, hs) -> float:
    t0 = time.perf_counter()
    for layer, h in enumerate(hs):
        for t in range(8):
            pred.predict(layer, h[t:t + 1])
    return (time.perf_counter() - t0) / 8 * 1e3


def study(args) -> dict:
    log = lambda m: print(m, file=sys.stderr, flush=True)                 # noqa: E731
    path = resolve_model(args.model, cache_dir(), registry_path(), log, dtype=args.dtype)
    flash = open_flash(path)
    cfg, tok = flash.config, Tokenizer.from_flash(flash)
    dense = DenseFfn(flash, 1)
    model = Model(flash, n_threads=1, n_ctx=args.n_ctx, ffn=dense)
    cal = tok.encode(builtin_text("calibration", "code", args.calib_tokens * 6).text)[:args.calib_tokens]
    ev = tok.encode(builtin_text("evaluation", "code", args.eval_tokens * 6).text)[:args.eval_tokens]
    args.bos = bos_to_add(tok, cfg.bos_token_id)
    log(f"{path}: {len(cal)} calibration / {len(ev)} evaluation tokens")
    hs = collect_ffn_inputs(model, cal, args.n_ctx)                     # n_layers x (N, d)
    crit = default_criterion(cfg)
    acts = [ffn_activations(flash, i, hs[i], crit) for i in range(cfg.n_layers)]  # (N, n_ff)
    acts_th = layer_thresholds(acts, args.sparsity)
    masks = [a >= t for a, t in zip(acts, acts_th)]                       # (N, n_ff) bool
    cut = int(len(hs[0]) * 0.75)
    held_h, held_m = [h[cut:] for h in hs], [m[cut:] for m in masks]
    out = {"model": str(path), "dtype": args.dtype, "sparsity": args.sparsity,
           "calib_tokens": len(cal), "eval_tokens": len(ev), "n_ctx": args.n_ctx, "rows": []}
    t0 = time.perf_counter()
    model.ffn = dense
    out["dense_ppl"] = eval_ppl(model, ev, args)
    model.ffn = SparseEval(dense, acts_th)
    out["oracle_ppl"] = eval_ppl(model, ev, args)
    log(f"dense {out['dense_ppl']:.4f}  oracle mask {out['oracle_ppl']:.4f} "
        f"({time.perf_counter() - t0:.0f} s)")
    for name in args.candidates:
        kind, kw = CANDIDATES[name]
        t0 = time.perf_counter()
        if kind == "sketch":
            pred = sketch_predictor(flash, hs, acts, acts_th, kw["quant"])
        elif kind == "static":
            pred = StaticHot([m[:cut] for m in masks])
        else:
            pred = train_predictor(flash, hs, acts, kind, acts_th, recall=0.95, **kw)
        curves = Curves(pred, [h[:cut] for h in hs], [m[:cut] for m in masks])
        ms = predict_ms(pred, held_h)
        log(f"{name}: fitted in {time.perf_counter() - t0:.0f} s, {pred.nbytes / 2**20:.1f} MiB, "
            f"{ms:.2f} ms/token")
        for load in args.loads:
            for alloc in args.alloc:
                th = curves.equal_load(load) if alloc == "load" else curves.equal_recall(load)
                pred.thresholds = th
                strat = SparseEval(dense, acts_th, pred, th)
                model.ffn = strat
                ppl = eval_ppl(model, ev, args)
                row = {"candidate": name, "kind": kind, "alloc": alloc, "target_load": load,
                       "eval_load": strat.loaded / max(strat.tokens, 1) / cfg.n_ff,
                       "ppl": ppl, "ppl_ratio": ppl / out["dense_ppl"],
                       "dram_bytes": pred.nbytes, "predict_ms_per_token": ms,
                       **held_out_metrics(pred, th, held_h, held_m)}
                out["rows"].append(row)
                log(f"  load {load:.2f} {alloc:6s}: eval load {row['eval_load']:.3f} "
                    f"ppl {ppl:.4f} (x{row['ppl_ratio']:.3f}) recall "
                    f"{np.mean(row['recall']):.3f} precision {np.mean(row['precision']):.3f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--dtype", default="q8_0")
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--eval-tokens", type=int, default=1024)
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--loads", default="0.4,0.5,0.6")
    ap.add_argument("--alloc", default="load,recall", help="per-layer thresholds: equal load "
                    "per layer, and/or one recall target for all layers at the same mean load")
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.loads = [float(v) for v in args.loads.split(",")]
    args.alloc = args.alloc.split(",")
    args.candidates = args.candidates.split(",")
    out = study(args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
