"""Can the self draft borrow the cold neurons' output from the position before? (issue 15,
session 22)

The self draft (generation/self_draft.py) computes each FFN over its cached neurons only; the
rest of the layer's output (the cold neurons') is missing. Session 18 found that neither their
mean output nor a linear map of the FFN input stands in for it (scripts/studies/draft_bias.py).
The stand-in measured here costs no fit: alpha times the cold output the whole model computed
at the previous position (a verifying pass could keep it: d_model floats a layer), added to the
draft's residual after its cached neurons.

Teacher-forced over held-out text (the built-in evaluation split, code then prose): at each
position the draft runs first, then the whole model (both with the layers' calibrated
thresholds, the FFN as a budgeted run computes it), and the draft's argmax is checked against the
model's. Both use the whole output head, so only the FFN differs.

    python -m scripts.studies.draft_cold $FLASHLLM_CACHE/converted/qwen2.5-coder-1.5b-native-cal \\
        --hot 4416 --positions 256 --alphas 0,0.5,1,fit

An alpha of `fit` lends what the runtime lends (runtime/resident.ColdCarry: each layer's share
fitted from the positions the whole model has computed so far).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flashllm.format.reader import open_flash
from flashllm.generation.tokenizer import Tokenizer
from flashllm.runtime.model import Model
from flashllm.runtime.resident import ColdCarry
from flashllm.sparsity.activations import manifest_thresholds
from flashllm.sparsity.calibrate import text_tokens
from flashllm.sparsity.corpus import builtin_text
from scripts.studies.draft_order import SubsetFfn


class Strategy:
    """An FFN strategy for Model: (whole model) the hot slots, then the cold ones, keeping each
    layer's cold output at the last position; or (draft) the hot slots plus alpha times the
    output `source` kept."""

    def __init__(self, sub: SubsetFfn, hot, cold=None, source=None, alpha: float = 0.0,
                 carry: ColdCarry | None = None):
        self.sub, self.hot, self.cold, self.source, self.alpha = sub, hot, cold, source, alpha
        self.kept: dict = {}                         # layer -> (d,) cold output, last position
        self.carry, self.pos0 = carry, 0             # alpha "fit": the runtime's ColdCarry

    def start_pass(self, n_tokens: int, prefill: bool, pos0: int = 0) -> None:
        self.pos0 = pos0
        if self.carry is not None and self.cold is not None:
            self.carry.start_pass(n_tokens, prefill, pos0)

    def stats(self) -> dict:
        return {}

    def __call__(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        self.sub.add(layer, h, x, self.hot)
        if self.cold is not None:
            before = x.copy()                                             # (T, d)
            self.sub.add(layer, h, x, self.cold)
            self.kept[layer] = x[-1] - before[-1]
            if self.carry is not None:
                self.carry.record(layer, x, before)
        elif self.carry is not None:
            self.carry.lend(layer, self.pos0, x)
        elif self.alpha and layer in self.source.kept:
            x += self.alpha * self.source.kept[layer]                     # (T, d)


def agreement(flash, sub: SubsetFfn, hot, cold, ids: list, alpha) -> int:
    """Positions of ids where the draft's argmax is the whole model's (alpha: a float, or "fit")."""
    carry = ColdCarry(flash.config.n_layers, flash.config.d_model) if alpha == "fit" else None
    full = Strategy(sub, hot, cold, carry=carry)
    model = Model(flash, n_threads=sub.n_threads, n_ctx=len(ids), ffn=full)
    draft = model.sibling(Strategy(sub, hot, source=full, alpha=0.0 if carry else alpha,
                                   carry=carry), model.w)
    hits = 0
    for pos, t in enumerate(ids):
        d = draft.forward(np.array([t], np.int32), pos)[0]                # (vocab,)
        m = model.forward(np.array([t], np.int32), pos)[0]                # (vocab,)
        hits += int(np.argmax(d) == np.argmax(m))
    return hits


@dataclass
class Split:
    """A teacher-forced draft study's setup: the model, its layers in DRAM, each layer's
    calibrated threshold, the hot (cached) and cold slots, and the held-out texts' ids."""

    flash: object
    layers: list                     # (n_ff, stride) bundles of each layer
    thresholds: np.ndarray           # (n_layers,)
    hot: np.ndarray                  # (n_hot,) slots
    cold: np.ndarray                 # (n_ff - n_hot,) slots
    texts: list                      # [code ids, prose ids], positions // 2 each


def study_args(doc: str, hot: int, positions: int, option: str, default: str):
    """The arguments of a draft study: MODEL, --hot, --positions, --threads and its own option."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--hot", type=int, default=hot, help="cached neurons a layer (560 MiB's plan)")
    ap.add_argument("--positions", type=int, default=positions)
    ap.add_argument(option, default=default)
    ap.add_argument("--threads", type=int, default=2)
    return ap.parse_args()


def split(model: Path, n_hot: int, positions: int) -> Split:
    flash = open_flash(model)
    cfg = flash.config
    layers = [np.ascontiguousarray(flash.read_ffn_layer(i))              # (n_ff, stride) each
              for i in range(cfg.n_layers)]
    thr = np.asarray(manifest_thresholds(flash.manifest, cfg.n_layers), np.float32)  # (L,)
    tok, n = Tokenizer.from_flash(flash), positions // 2
    texts = [text_tokens(tok, builtin_text("evaluation", k).text, n) for k in ("code", "prose")]
    return Split(flash, layers, thr, np.arange(n_hot, dtype=np.int32),
                 np.arange(n_hot, cfg.n_ff, dtype=np.int32), texts)


def main() -> None:
    a = study_args(__doc__, 4416, 256, "--alphas", "0,0.5,1")
    s = split(a.model, a.hot, a.positions)
    sub = SubsetFfn(s.flash, s.layers, s.thresholds, a.threads)
    n = a.positions // 2
    for alpha in (x if x == "fit" else float(x) for x in a.alphas.split(",")):
        hits = [agreement(s.flash, sub, s.hot, s.cold, ids, alpha) for ids in s.texts]
        print(f"hot {a.hot} of {s.flash.config.n_ff}, previous x {alpha}: draft = model on code "
              f"{hits[0]}/{n}, prose {hits[1]}/{n}", flush=True)


if __name__ == "__main__":
    main()
