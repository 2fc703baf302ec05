"""Does the draft agree more when it adds back what its missing neurons contribute on average?
(issue 15, self-speculation). The resident sub-network drops each layer's cold neurons (the slots
past the caches' n_hot in the hot-first order); structured pruning restores part of what they
did with a bias: their mean output over calibration text (FLAP, An et al. 2024), or more with a
linear map from the FFN input. This measures, teacher-forced over held-out text, how often the
draft's argmax equals the whole model's with no compensation, a mean bias (d floats a layer),
and a ridge-fitted linear map (d x d a layer; its rank-r truncations: r (2d) floats).

    python -m scripts.studies.draft_bias $FLASHLLM_CACHE/converted/qwen2.5-coder-1.5b-native-cal \\
        --hot 0.49,0.07 --positions 256

The model runs over each text first (its argmax and keys/values kept); at each position the
draft runs reading the model's keys and values of earlier positions, and the model's own are
put back after it. Both use the whole output head: only the FFN differs.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from flashllm.format.reader import open_flash
from flashllm.generation.tokenizer import Tokenizer
from flashllm.runtime.ffn import DenseFfn
from flashllm.runtime.model import Model
from flashllm.sparsity.activations import manifest_thresholds
from flashllm.sparsity.calibrate import collect_ffn_inputs, text_tokens
from flashllm.sparsity.corpus import builtin_text
from scripts.studies.draft_order import SubsetFfn


OUTLIER = 4.0      # inputs this many times the median norm are left out of the linear fit


class CompensatedFfn(SubsetFfn):
    """The FFN over the first n_hot slots, plus bias[layer] (d,) and h @ maps[layer] (d, d)."""

    def __init__(self, flash, layers, thresholds, n_threads: int):
        super().__init__(flash, layers, thresholds, n_threads)
        self.bias: list = []                  # per layer (d,), or none
        self.maps: list = []                  # per layer (d, d), or none

    def __call__(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        super().__call__(layer, h, x)
        if self.bias:
            x += self.bias[layer]                                          # (T, d)
        if self.maps:
            x += h @ self.maps[layer]                                      # (T, d)


def cold_outputs(sub: SubsetFfn, layer: int, h: np.ndarray, n_ff: int, k: int) -> np.ndarray:
    """(N, d) what the slots k.. add to the layer's output for inputs h (N, d)."""
    out = np.zeros_like(h)                                                  # (N, d)
    sub.rows = [np.arange(k, n_ff, dtype=np.int32)] * len(sub.layers)
    for s in range(0, len(h), 256):
        sub(layer, h[s:s + 256], out[s:s + 256])
    return out


def fit(inputs, sub, n_ff: int, k: int, ranks, ridge: float):
    """Per layer: the mean cold output (d,), and the ridge map (d, d) of the centred cold
    outputs on the centred inputs, truncated to each rank in ranks (None: full)."""
    bias, maps = [], {r: [] for r in ranks}
    for layer, h in enumerate(inputs):
        y = cold_outputs(sub, layer, h, n_ff, k)                           # (N, d)
        mu_y = y.mean(0)                                                   # (d,)
        norms = np.linalg.norm(h, axis=1)                                  # (N,)
        keep = norms < OUTLIER * np.median(norms)      # not the first tokens' massive inputs
        h, y = h[keep], y[keep]                                            # (n, d)
        mu_h = h.mean(0)                                                   # (d,)
        hc = (h - mu_h).astype(np.float64)                                 # (n, d)
        gram = hc.T @ hc                                                   # (d, d)
        gram += ridge * np.trace(gram) / len(gram) * np.eye(len(gram))
        a = np.linalg.solve(gram, hc.T @ (y - mu_y))                       # (d, d)
        u, s, vt = np.linalg.svd(a)
        for r in ranks:
            m = a if r is None else (u[:, :r] * s[:r]) @ vt[:r]            # (d, d)
            maps[r].append((m.astype(np.float32), (y.mean(0) - mu_h @ m).astype(np.float32)))
        bias.append(mu_y.astype(np.float32))
    return bias, maps


def agreement(flash, sub, texts, n_threads: int) -> list[int]:
    """Positions of each text where the draft's argmax is the model's."""
    out = []
    for ids in texts:
        model = Model(flash, n_threads=n_threads, n_ctx=len(ids), ffn=DenseFfn(flash, n_threads))
        want = np.argmax(model.forward(np.array(ids, np.int32), 0), axis=1)   # (n,)
        k, v = model.k_cache.copy(), model.v_cache.copy()
        draft = model.sibling(sub, model.w)
        hits = 0
        for pos, t in enumerate(ids):
            hits += int(np.argmax(draft.forward(np.array([t], np.int32), pos)[0]) == want[pos])
            model.k_cache[:, pos], model.v_cache[:, pos] = k[:, pos], v[:, pos]
        out.append(hits)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--hot", default="0.49,0.07")
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--calibration-tokens", type=int, default=1024)
    ap.add_argument("--ranks", default="16,64,full")
    ap.add_argument("--ridge", type=float, default=0.3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    flash = open_flash(a.model)
    cfg = flash.config
    thr = manifest_thresholds(flash.manifest, cfg.n_layers)
    tok = Tokenizer.from_flash(flash)
    cal = text_tokens(tok, builtin_text("calibration", "code").text, a.calibration_tokens)
    dense = Model(flash, n_threads=a.threads, n_ctx=512, ffn=DenseFfn(flash, a.threads))
    inputs = collect_ffn_inputs(dense, cal)                                # L x (N, d)
    layers = [np.ascontiguousarray(flash.read_ffn_layer(i)) for i in range(cfg.n_layers)]
    n = a.positions // 2
    texts = [text_tokens(tok, builtin_text("evaluation", kind).text, n) for kind in ("code", "prose")]
    ranks = [None if r == "full" else int(r) for r in a.ranks.split(",")]
    for share in (float(s) for s in a.hot.split(",")):
        k = int(share * cfg.n_ff)
        sub = CompensatedFfn(flash, layers, thr, a.threads)
        bias, maps = fit(inputs, sub, cfg.n_ff, k, ranks, a.ridge)
        sub.rows = [np.arange(k, dtype=np.int32)] * cfg.n_layers
        variants = {"none": ([], []), "mean bias": (bias, [])}
        for r in ranks:
            variants[f"linear r{r or 'full'}"] = ([b for _, b in maps[r]], [m for m, _ in maps[r]])
        for name, (sub.bias, sub.maps) in variants.items():
            code, prose = agreement(flash, sub, texts, a.threads)
            print(f"hot {share:.2f} ({k} a layer) {name:14s}: draft = model on code {code}/{n}, "
                  f"prose {prose}/{n}", flush=True)


if __name__ == "__main__":
    main()
