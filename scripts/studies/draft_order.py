"""Which neurons make the best draft (issue 15, self-speculation): the resident sub-network holds
the first n_hot slots of each layer (the hot-first order; before session 15 by calibration
frequency of |h| >= threshold, since then by contribution on GLU models). On a SwiGLU model
about half the neurons pass the threshold on any token, so frequency barely ranks them; a
neuron's expected contribution to the layer's output, E|h_i| * ||down_i||, might.
This measures, teacher-forced over held-out text, how often the draft's argmax (the FFN over a
chosen n_hot neurons per layer, everything else exact) equals the whole model's, for the
resident set chosen by frequency (the model's frequency file) and by contribution (measured
here on the calibration tokens).

    python -m scripts.studies.draft_order $FLASHLLM_CACHE/converted/qwen2.5-coder-1.5b-native-cal \\
        --hot 0.5,0.25 --positions 256

At each position the draft runs first (writing its keys and values there), then the whole model
(overwriting them), as a verifying pass does: the draft reads the model's keys and values of
every earlier position. Both use the whole output head, so only the FFN differs.
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
from flashllm.sparsity.activations import (contribution, down_norms, ffn_activations,
                                           manifest_thresholds)
from flashllm.sparsity.calibrate import collect_ffn_inputs, text_tokens
from flashllm.sparsity.corpus import builtin_text


class SubsetFfn:
    """The FFN over a chosen set of bundle slots per layer (in DRAM), thresholds as calibrated."""

    def __init__(self, flash, layers, thresholds, n_threads: int):
        self.flash, self.layers, self.thr, self.n_threads = flash, layers, thresholds, n_threads
        self.rows: list[np.ndarray] = []                                   # per layer (n_hot,)
        self.ids = [bundle_ids(flash, i) for i in range(flash.config.n_layers)]

    def start_pass(self, n_tokens: int, prefill: bool, pos0: int = 0) -> None:
        pass

    def __call__(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        self.add(layer, h, x, self.rows[layer])

    def add(self, layer: int, h: np.ndarray, x: np.ndarray, rows: np.ndarray) -> None:
        """x (T, d) += the FFN over slots rows (k,) of layer for inputs h (T, d)."""
        f, cfg = self.flash.ffn, self.flash.config
        kernel.ffn_bundles(self.layers[layer], f.dtype, cfg.d_model, cfg.glu, cfg.act, h, x,
                           ids=self.ids[layer], n_threads=self.n_threads, rows=rows,
                           threshold=self.thr[layer], down_dtype=f.down_dtypes[layer])

    def stats(self) -> dict:
        return {}


def contributions(flash, inputs, crit: str, n_threads: int) -> np.ndarray:
    """(L, n_ff) E_t |h_ti| * ||down_i|| per slot over the calibration inputs."""
    return np.stack([contribution(ffn_activations(flash, i, h, crit, n_threads=n_threads),
                                  down_norms(flash, i, n_threads))
                     for i, h in enumerate(inputs)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--hot", default="0.5,0.25")
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--calibration-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    flash = open_flash(a.model)
    cfg = flash.config
    thr = manifest_thresholds(flash.manifest, cfg.n_layers)
    crit = flash.manifest["sparsity"]["criterion"]
    tok = Tokenizer.from_flash(flash)
    cal = text_tokens(tok, builtin_text("calibration", "code").text, a.calibration_tokens)
    dense = Model(flash, n_threads=a.threads, n_ctx=512, ffn=DenseFfn(flash, a.threads))
    score = contributions(flash, collect_ffn_inputs(dense, cal), crit, a.threads)     # (L, n_ff)
    e = flash.manifest["sparsity"]["frequency"]
    freq = np.fromfile(a.model / e["file"], "<f4").reshape(cfg.n_layers, cfg.n_ff)  # (L, n_ff)
    layers = [np.ascontiguousarray(flash.read_ffn_layer(i)) for i in range(cfg.n_layers)]
    sub = SubsetFfn(flash, layers, thr, a.threads)
    n = a.positions // 2
    texts = [text_tokens(tok, builtin_text("evaluation", k).text, n) for k in ("code", "prose")]
    for share in (float(s) for s in a.hot.split(",")):
        k = int(share * cfg.n_ff)
        top = [np.sort(np.argsort(-v, kind="stable")[:k]).astype(np.int32) for v in freq]
        orders = {"frequency": top,
                  "contribution": [np.sort(np.argsort(-s)[:k]).astype(np.int32) for s in score]}
        for name, rows in orders.items():
            sub.rows = rows
            overlap = np.mean([np.isin(r, f).mean() for r, f in zip(rows, top)])
            agree = []
            for ids in texts:
                model = Model(flash, n_threads=a.threads, n_ctx=n, ffn=DenseFfn(flash, a.threads))
                draft = model.sibling(sub, model.w)
                hits = 0
                for pos, t in enumerate(ids):
                    d = draft.forward(np.array([t], np.int32), pos)[0]     # (vocab,)
                    m = model.forward(np.array([t], np.int32), pos)[0]     # (vocab,)
                    hits += int(np.argmax(d) == np.argmax(m))
                agree.append(hits)
            print(f"hot {share:.2f} ({k} a layer) by {name:12s} (shares {overlap:.2f} with "
                  f"frequency's): draft = model on code {agree[0]}/{n}, prose {agree[1]}/{n}",
                  flush=True)


if __name__ == "__main__":
    main()
