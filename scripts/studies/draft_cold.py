"""Can the self draft stand in for the neurons it does not hold? (issue 15, session 22)

The self draft (generation/self_draft.py) computes each FFN over its layer's cached neurons only;
the rest of the layer's output (the cold neurons') is missing. Two cheap stand-ins for it, added
to the draft's residual after the cached neurons:

    linear   a rank-r map of the FFN input, fitted (ridge) on calibration tokens: cold ~ h A + b
             (DRAM: 2 r d_model floats a layer)
    previous alpha times the cold output the whole model computed at the previous position (a
             verifying pass could keep it: d_model floats a layer, no fit)

Teacher-forced over held-out text (the built-in evaluation split, code then prose): at each
position the draft runs first, then the whole model (both with the layers' calibrated
thresholds, the FFN as a budgeted run computes it), and the draft's argmax is checked against the
model's. Both use the whole output head, so only the FFN differs.

    python -m scripts.studies.draft_cold $FLASHLLM_CACHE/converted/qwen2.5-coder-1.5b-native-cal \\
        --hot 4416 --positions 256 --alphas 0,0.5,1 --rank 128
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from flashllm.ffi import kernel
from flashllm.format.reader import open_flash
from flashllm.generation.tokenizer import Tokenizer
from flashllm.runtime.ffn import DenseFfn, bundle_ids
from flashllm.runtime.model import Model
from flashllm.sparsity.activations import manifest_thresholds
from flashllm.sparsity.calibrate import collect_ffn_inputs, text_tokens
from flashllm.sparsity.corpus import builtin_text


class Layers:
    """Every layer's bundles in DRAM and an FFN over a chosen set of them (thresholded)."""

    def __init__(self, flash, n_threads: int):
        self.flash, self.cfg, self.n_threads = flash, flash.config, n_threads
        self.thr = manifest_thresholds(flash.manifest, self.cfg.n_layers)
        self.data = [np.ascontiguousarray(flash.read_ffn_layer(i))              # (n_ff, stride)
                     for i in range(self.cfg.n_layers)]
        self.ids = [bundle_ids(flash, i) for i in range(self.cfg.n_layers)]

    def add(self, layer: int, h: np.ndarray, x: np.ndarray, rows: np.ndarray) -> None:
        """x (T, d) += the FFN over bundle rows (k,) of layer for inputs h (T, d)."""
        f, c = self.flash.ffn, self.cfg
        kernel.ffn_bundles(self.data[layer], f.dtype, c.d_model, c.glu, c.act, h, x,
                           ids=self.ids[layer], n_threads=self.n_threads, rows=rows,
                           threshold=self.thr[layer], down_dtype=f.down_dtypes[layer])


class Strategy:
    """An FFN strategy for Model: hot rows, then (whole model) the cold rows, keeping each
    layer's cold output at the last position; or (draft) hot rows plus a stand-in."""

    def __init__(self, layers: Layers, hot, cold=None, stand_in=None):
        self.layers, self.hot, self.cold, self.stand_in = layers, hot, cold, stand_in
        self.kept: dict = {}                         # layer -> (d,) cold output, last position

    def start_pass(self, n_tokens: int, prefill: bool) -> None:
        pass

    def stats(self) -> dict:
        return {}

    def __call__(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        self.layers.add(layer, h, x, self.hot)
        if self.cold is not None:
            before = x[-1].copy()                                         # (d,)
            self.layers.add(layer, h, x, self.cold)
            self.kept[layer] = x[-1] - before
        elif self.stand_in is not None:
            x += self.stand_in(layer, h)


def fit_linear(layers: Layers, inputs: list, cold, rank: int) -> list:
    """Per layer (A (d, d) of rank `rank`, b (d,)): the ridge fit of the cold output on the FFN
    input over the calibration inputs [(N, d)], projected on its top `rank` output directions."""
    fits = []
    for i, h in enumerate(inputs):
        y = np.zeros_like(h)                                              # (N, d)
        layers.add(i, h, y, cold)
        hc, yc = (h - h.mean(0)).astype(np.float64), (y - y.mean(0)).astype(np.float64)
        g = hc.T @ hc                                                     # (d, d)
        a = np.linalg.solve(g + 1e-2 * np.trace(g) / len(g) * np.eye(len(g)), hc.T @ yc)
        vt = np.linalg.svd(hc @ a, full_matrices=False)[2][:rank]         # (rank, d)
        a = (a @ vt.T @ vt).astype(np.float32)                           # (d, d)
        fits.append((a, (y.mean(0) - h.mean(0) @ a).astype(np.float32)))
    return fits


def agreement(flash, layers: Layers, hot, cold, ids: list, stand_in_of) -> int:
    """Positions of ids where the draft's argmax is the whole model's; stand_in_of(model's
    strategy) -> the draft's stand-in (or None)."""
    full = Strategy(layers, hot, cold)
    model = Model(flash, n_threads=layers.n_threads, n_ctx=len(ids), ffn=full)
    draft = model.sibling(Strategy(layers, hot, stand_in=stand_in_of(full)), model.w)
    hits = 0
    for pos, t in enumerate(ids):
        d = draft.forward(np.array([t], np.int32), pos)[0]                # (vocab,)
        m = model.forward(np.array([t], np.int32), pos)[0]                # (vocab,)
        hits += int(np.argmax(d) == np.argmax(m))
    return hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--hot", type=int, default=4416, help="cached neurons a layer (560 MiB's plan)")
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--alphas", default="0,0.5,1")
    ap.add_argument("--rank", type=int, default=128, help="the linear stand-in's rank (0: none)")
    ap.add_argument("--calibration-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    flash = open_flash(a.model)
    tok, n_ff = Tokenizer.from_flash(flash), flash.config.n_ff
    layers = Layers(flash, a.threads)
    hot, cold = np.arange(a.hot, dtype=np.int32), np.arange(a.hot, n_ff, dtype=np.int32)
    n = a.positions // 2
    texts = [text_tokens(tok, builtin_text("evaluation", k).text, n) for k in ("code", "prose")]
    kinds = {f"previous x {al:g}": (lambda full, al=al: None if al == 0 else
                                     (lambda i, h: al * full.kept[i] if i in full.kept else 0.0))
             for al in (float(s) for s in a.alphas.split(","))}
    if a.rank:
        cal = text_tokens(tok, builtin_text("calibration", "code").text, a.calibration_tokens)
        dense = Model(flash, n_threads=a.threads, n_ctx=512, ffn=DenseFfn(flash, a.threads))
        fits = fit_linear(layers, collect_ffn_inputs(dense, cal), cold, a.rank)
        kinds[f"linear rank {a.rank}"] = lambda full: (lambda i, h: h @ fits[i][0] + fits[i][1])
    for name, stand_in_of in kinds.items():
        hits = [agreement(flash, layers, hot, cold, ids, stand_in_of) for ids in texts]
        print(f"hot {a.hot} of {n_ff}, {name}: draft = model on code {hits[0]}/{n}, prose "
              f"{hits[1]}/{n}", flush=True)


if __name__ == "__main__":
    main()
