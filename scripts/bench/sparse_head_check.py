"""How often the sparse output head's candidates hold what the sampler keeps, on held-out text.

Run:  python -m scripts.bench.sparse_head_check MODEL [--tokens 10000] [--z 5] [--top-k 40]
MODEL: a converted folder with a head sketch. The text is the built-in evaluation split, code and
prose in halves (flashllm.sparsity.corpus; calibration never reads it), or --text FILE. The dense
model runs it teacher-forced in windows of 512; at every position the full head's logits are
compared with the sparse head's candidates (runtime/sparse_head.py) for greedy (the argmax must be
a candidate: the sparse head's token then equals the full head's, as both multiply the same rows
with the same kernel) and for top-k (every one of the full head's top k). Prints one JSON line:
the share of positions where each holds, and the candidates' rows and 4 KiB pages per position.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from flashllm.format.reader import open_flash
from flashllm.generation.tokenizer import Tokenizer
from flashllm.runtime.model import Model
from flashllm.runtime.sparse_head import HeadNeed, SparseHead
from flashllm.runtime.weights import DenseWeights
from flashllm.sparsity.calibrate import text_tokens
from flashllm.sparsity.corpus import builtin_text, file_text

WINDOW = 512


def held_out(flash, n: int, text: Path | None) -> np.ndarray:
    """(n,) token ids of the evaluation text (code then prose) or of a file."""
    tok = Tokenizer.from_flash(flash)
    if text is not None:
        return np.array(text_tokens(tok, file_text(text).text, n), np.int32)
    return np.array(sum((text_tokens(tok, builtin_text("evaluation", k, 60 * n).text, n // 2)
                         for k in ("code", "prose")), []), np.int32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=10000)
    ap.add_argument("--z", type=float, default=None, help="bound width (default: the runtime's)")
    ap.add_argument("--top-k", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text", type=Path, default=None)
    args = ap.parse_args()
    flash = open_flash(args.model)
    ids = held_out(flash, args.tokens, args.text)                       # (n,)
    net = Model(flash, n_threads=args.threads, n_ctx=WINDOW)
    kw = {} if args.z is None else {"z": args.z}
    head = SparseHead(flash, DenseWeights(flash, args.threads), HeadNeed(1), args.threads, **kw)
    needs = {"greedy": HeadNeed(1), f"top{args.top_k}": HeadNeed(args.top_k)}
    hits = {k: 0 for k in needs}
    rows = {k: [] for k in hits}
    pages = {k: [] for k in hits}
    for s in range(0, len(ids), WINDOW):
        net.reset()
        xs = []
        real = net.w.output
        net.w.output = lambda x, exact=False: (xs.append(x.copy()), real(x, exact))[1]
        logits = net.forward(ids[s:s + WINDOW], 0)                      # (T, vocab)
        net.w.output = real
        if head.dims is None:               # as a run: from hidden states past the first token
            head.exact_dims(xs[0][1:])
        for t0 in range(0, len(logits), 64):
            hi, lo = head.bounds(xs[0][t0:t0 + 64])                     # (64, vocab) each
            for t in range(len(hi)):
                full = logits[t0 + t]                                   # (vocab,)
                for key, need in needs.items():
                    cand = head.candidates(hi[t], lo[t], need)          # (k,)
                    want = np.argpartition(-full, need.top)[:need.top]
                    hits[key] += bool(np.isin(want, cand).all())
                    rows[key].append(len(cand))
                    pages[key].append(head.pages_of(cand))
        print(f"[{min(s + WINDOW, len(ids))}/{len(ids)}] {hits}", flush=True)
    n = len(ids)
    out = {"model": str(args.model), "tokens": n, "z": head.z}
    for key in hits:
        r = np.array(rows[key])
        out[key] = {"held": hits[key] / n, "missed": n - hits[key], "rows_mean": float(r.mean()),
                    "rows_p50_p99_max": [int(np.percentile(r, p)) for p in (50, 99, 100)],
                    "KiB_mean": float(np.mean(pages[key]) * 4)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
