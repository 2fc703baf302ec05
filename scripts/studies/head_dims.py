"""How many hidden dims should the sparse output head keep exact?

Run:  python -m scripts.studies.head_dims MODEL [--tokens 192] [--dims 0,1,2,4,8,16] [--threads 2]
MODEL: a converted flash folder with a head sketch. The dense model runs the built-in evaluation
texts (code and prose in halves, flashllm.sparsity.corpus; calibration never reads them); for each
count k the k dims with the most energy over the positions past the first get exact columns
(runtime/sparse_head.py, SparseHead.exact_dims with no share floor), and every position's
candidates are counted for greedy and top-40, with a check that they hold the exact argmax and top
40 (the full head's logits, computed by the same model). Prints the energy share of the largest
dims, then one JSON line per k: the share the k dims hold, candidate rows (mean, p99) and whether
every position held what it must.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from flashllm.format.reader import open_flash
from flashllm.runtime.sparse_head import HeadNeed, SparseHead
from flashllm.runtime.weights import DenseWeights
from scripts.studies.head_sketch import hidden_states
from scripts.bench.sparse_head_check import held_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--dims", default="0,1,2,4,8,16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    flash = open_flash(args.model)
    x = hidden_states(flash, held_out(flash, args.tokens, None), args.threads)  # (n, d)
    weights = DenseWeights(flash, args.threads)               # unpacked: columns read from rows
    full = weights.output(x)                                                # (n, vocab)
    energy = (x[1:].astype(np.float64) ** 2).sum(axis=0)                    # (d,)
    share = np.sort(energy)[::-1] / energy.sum()                            # (d,)
    print(json.dumps({"largest_shares": [round(float(v), 4) for v in share[:16]]}))
    for k in (int(v) for v in args.dims.split(",")):
        head = SparseHead(flash, weights, HeadNeed(1), args.threads)
        head.exact_dims(x[1:], most=k, share=0.0)
        hi, lo = head.bounds(x)                                             # (n, vocab) each
        out = {"dims": k, "share": round(float(share[:k].sum()), 4)}
        for top in (1, 40):
            sizes, held = [], True
            for t in range(len(x)):
                cand = head.candidates(hi[t], lo[t], HeadNeed(top))
                held &= bool(np.isin(np.argsort(-full[t])[:top], cand).all())
                sizes.append(len(cand))
            out[f"top{top}"] = {"mean": round(float(np.mean(sizes)), 1),
                                "p99": float(np.percentile(sizes, 99)), "held": held}
        print(json.dumps(out))


if __name__ == "__main__":
    main()
