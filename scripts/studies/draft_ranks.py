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
    draft's probability of its own first token (n,) f64."""
    model = Model(flash, n_threads=n_threads, n_ctx=len(ids), ffn=DenseFfn(flash, n_threads))
    want = np.argmax(model.forward(np.array(ids, np.int32), 0), axis=1)             # (n,)
    k, v = model.k_cache.copy(), model.v_cache.copy()
    draft = model.sibling(sub, SketchHead(model.w, flash.tensor(SKETCH)) if sketch else model.w)
    rank, p1 = np.zeros(len(ids), np.int64), np.zeros(len(ids))                    # (n,) each
    for pos, t in enumerate(ids):
        logits = draft.forward(np.array([t], np.int32), pos)[0].astype(np.float64)  # (vocab,)
        rank[pos] = int((logits > logits[want[pos]]).sum())
        e = np.exp(logits - logits.max())
        p1[pos] = 1.0 / e.sum()
        model.k_cache[:, pos], model.v_cache[:, pos] = k[:, pos], v[:, pos]
    return rank, p1


def report(kind: str, rank: np.ndarray, p1: np.ndarray) -> None:
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
    cfg = flash.config
    sub = SubsetFfn(flash, [np.ascontiguousarray(flash.read_ffn_layer(i))
                            for i in range(cfg.n_layers)],
                    manifest_thresholds(flash.manifest, cfg.n_layers), a.threads)
    sub.rows = [np.arange(int(a.hot * cfg.n_ff), dtype=np.int32)] * cfg.n_layers
    tok = Tokenizer.from_flash(flash)
    for kind in ("code", "prose"):
        ids = text_tokens(tok, builtin_text("evaluation", kind).text, a.positions // 2)
        report(kind, *ranks(flash, sub, ids, a.threads, a.head == "sketch"))


if __name__ == "__main__":
    main()
