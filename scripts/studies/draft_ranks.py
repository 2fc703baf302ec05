"""Where the model's next token sits in the draft's ranking (issue 15, self-speculation): how often
the draft's first, second or third most likely token is the model's, by the draft's confidence in
its first. A verifying pass can check a guess's runner-up beside it (generation/self_draft.py,
siblings) for the compute of one more token and no read: this measures what that can gain.

    python -m scripts.studies.draft_ranks $FLASHLLM_CACHE/converted/qwen2.5-coder-1.5b-native-cal \\
        --hot 0.49 --positions 384

Teacher-forced over the built-in evaluation split (code, then prose; calibration never reads it):
the whole model runs each text first (its argmax and keys/values kept); at each position the
draft (each FFN over its first n_hot slots in the hot-first order, everything else exact, the
whole output head) reads the model's keys and values of the earlier positions, and the model's
own are put back after it. --head sketch: the draft's logits from the head's Q2_K sketch
(convert/head_sketch.py) instead of the head, as a draft holding sketch rows would rank them.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from flashllm.ffi import kernel
from flashllm.format.layout import SKETCH
from flashllm.format.reader import open_flash
from flashllm.generation.tokenizer import Tokenizer
from flashllm.runtime.ffn import DenseFfn
from flashllm.runtime.model import Model
from flashllm.sparsity.activations import manifest_thresholds
from flashllm.sparsity.calibrate import text_tokens
from flashllm.sparsity.corpus import builtin_text
from scripts.studies.draft_order import SubsetFfn

BANDS = (0.0, 0.3, 0.5, 0.75, 0.9, 1.01)     # the draft's probability of its first token


class SketchHead:
    """Dense weights whose output head is the Q2_K sketch (the rest: `w`'s)."""

    def __init__(self, w, sketch):
        self.w, self.sketch = w, sketch

    def __getattr__(self, name):
        return getattr(self.w, name)

    def output(self, x: np.ndarray, exact: bool = False) -> np.ndarray:
        xp = np.zeros((len(x), self.sketch.cols), np.float32)                      # (T, d_pad)
        xp[:, :x.shape[1]] = x
        return kernel.matmul(self.sketch, xp, None, self.w.n_threads)             # (T, vocab)


def ranks(flash, sub, ids: list[int], n_threads: int,
          sketch: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per position of ids: the model's token's rank among the draft's logits (n,) int, and the
    draft's probabilities of its own first and second tokens (n, 2) f64."""
    model = Model(flash, n_threads=n_threads, n_ctx=len(ids), ffn=DenseFfn(flash, n_threads))
    want = np.argmax(model.forward(np.array(ids, np.int32), 0), axis=1)             # (n,)
    k, v = model.k_cache.copy(), model.v_cache.copy()
    draft = model.sibling(sub, SketchHead(model.w, flash.tensor(SKETCH)) if sketch else model.w)
    rank, p12 = np.zeros(len(ids), np.int64), np.zeros((len(ids), 2))             # (n,) (n, 2)
    for pos, t in enumerate(ids):
        logits = draft.forward(np.array([t], np.int32), pos)[0].astype(np.float64)  # (vocab,)
        rank[pos] = int((logits > logits[want[pos]]).sum())
        e = np.exp(logits - logits.max())
        p12[pos] = np.sort(np.partition(e, -2)[-2:])[::-1] / e.sum()     # top two, no full sort
        model.k_cache[:, pos], model.v_cache[:, pos] = k[:, pos], v[:, pos]
    return rank, p12


def report(kind: str, rank: np.ndarray, p12: np.ndarray) -> None:
    p1 = p12[:, 0]
    print(f"{kind}: {len(rank)} positions; the model's token is the draft's first "
          f"{(rank < 1).mean():.2f}, in its first two {(rank < 2).mean():.2f}, "
          f"three {(rank < 3).mean():.2f}")
    for lo, hi in zip(BANDS, BANDS[1:]):
        m = (p1 >= lo) & (p1 < hi)
        if m.any():
            print(f"  draft's p(first) {lo:.2f}-{min(hi, 1):.2f}: {m.sum():4d} positions, first "
                  f"{(rank[m] < 1).mean():.2f}, first two {(rank[m] < 2).mean():.2f}, "
                  f"first three {(rank[m] < 3).mean():.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--hot", type=float, default=0.49, help="share of each layer's neurons")
    ap.add_argument("--positions", type=int, default=384, help="half code, half prose")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--head", choices=("exact", "sketch"), default="exact")
    a = ap.parse_args()
    flash = open_flash(a.model)
    sub = draft_ffn(flash, a.hot, a.threads)
    for kind, ids in held_out(flash, a.positions):
        report(kind, *ranks(flash, sub, ids, a.threads, a.head == "sketch"))


def draft_ffn(flash, hot: float, n_threads: int) -> SubsetFfn:
    """The draft's FFN: each layer over its first hot * n_ff slots (hot-first order), every
    layer's bundles read into DRAM, the calibrated thresholds."""
    cfg = flash.config
    sub = SubsetFfn(flash, [np.ascontiguousarray(flash.read_ffn_layer(i))
                            for i in range(cfg.n_layers)],
                    manifest_thresholds(flash.manifest, cfg.n_layers), n_threads)
    sub.rows = [np.arange(int(hot * cfg.n_ff), dtype=np.int32)] * cfg.n_layers
    return sub


def held_out(flash, positions: int) -> list[tuple[str, list[int]]]:
    """[(kind, token ids)] of the evaluation split's code and prose, positions // 2 each."""
    tok = Tokenizer.from_flash(flash)
    return [(kind, text_tokens(tok, builtin_text("evaluation", kind).text, positions // 2))
            for kind in ("code", "prose")]


if __name__ == "__main__":
    main()
