"""When should the self draft stop guessing (issue 15, self-speculation)? Replays rules over the
draft's teacher-forced ranks (scripts/studies/draft_ranks.py) under a pass-cost model.

    python -m scripts.studies.draft_stop $FLASHLLM_CACHE/converted/qwen2.5-coder-1.5b-native-cal \\
        --hot 0.49 --positions 512 --costs 0.15,0.008,0.02

A pass from position i checks guesses for i, i + 1, ..: guess j is kept when the model's token
at i + j is the draft's first (rank 0) and every guess before it was kept; where guess j < 2
fails, its sibling (the draft's runner-up, p2 >= 0.1) is taken when it is the model's token
(rank 1), one token more. A pass costs c1 + ce * (guesses + siblings) and its drafting d per
guess (costs: --costs c1,ce,d in seconds). Rules:

- pmin K: at most K guesses, stop after one the draft gives p1 < 0.5 (today's rule, K learned
  by speculate.DraftLength from the mean acceptance);
- reach T: keep guessing while the chance that every guess so far is kept, the product of the
  acceptance the draft's p1 band had on the *other* text (cross-fitted), is at least T.

Greedy; teacher-forced (the draft reads the model's keys and values of the verified positions, as
in a run; positions past a failed guess are approximations that only change the pass's cost).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from flashllm.generation.self_draft import SIBLING_P_MIN, SIBLINGS

BANDS = np.array([0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.01])


def band_acceptance(rank: np.ndarray, p12: np.ndarray) -> np.ndarray:
    """(bands,) share of positions whose first guess is the model's token, per p1 band
    (Laplace-smoothed)."""
    b = np.digitize(p12[:, 0], BANDS) - 1                                          # (n,)
    hit = np.bincount(b, weights=(rank == 0), minlength=len(BANDS))
    n = np.bincount(b, minlength=len(BANDS))
    return (hit + 1) / (n + 2)


def replay(rank, p12, rule: str, value: float, costs, accept=None) -> tuple[float, float]:
    """(tokens a pass, tokens a second) of a rule over the positions."""
    c1, ce, d = costs
    n, i, tokens, seconds, passes = len(rank), 0, 0, 0.0, 0
    while i < n - 1:
        k, reach = 0, 1.0
        while i + k < n - 1:
            p1 = p12[i + k, 0]
            k += 1
            if rule == "pmin":
                if k >= value or p1 < 0.5:
                    break
            else:
                reach *= accept[np.digitize(p1, BANDS) - 1]
                if reach < value or k >= 16:
                    break
        m = 0
        while m < k and rank[i + m] == 0:
            m += 1
        sibs = sum(1 for j in range(min(k, SIBLINGS)) if p12[i + j, 1] >= SIBLING_P_MIN)
        made = m + 1
        if m < k and m < SIBLINGS and p12[i + m, 1] >= SIBLING_P_MIN and rank[i + m] == 1:
            made += 1
        tokens, passes = tokens + made, passes + 1
        seconds += c1 + ce * (k + sibs) + d * k
        i += made
    return tokens / passes, tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--hot", type=float, default=0.49)
    ap.add_argument("--positions", type=int, default=512, help="half code, half prose")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--costs", default="0.15,0.008,0.02", help="c1,ce,d seconds")
    ap.add_argument("--cache", type=Path, help="an .npz of the ranks: made once, then read")
    a = ap.parse_args()
    costs = tuple(float(c) for c in a.costs.split(","))
    if a.cache is not None and a.cache.exists():
        data = dict(np.load(a.cache))
    else:
        data = _ranks(a)
        if a.cache is not None:
            np.savez(a.cache, **data)
    for kind, other in (("code", "prose"), ("prose", "code")):
        rank, p12 = data[f"{kind}_rank"], data[f"{kind}_p"]
        accept = band_acceptance(data[f"{other}_rank"], data[f"{other}_p"])
        print(f"{kind}: {len(rank)} positions, first guess kept {np.mean(rank == 0):.2f}")
        for rule, values in (("pmin", (2, 3, 4, 6, 8)), ("reach", (0.5, 0.4, 0.3, 0.2, 0.1))):
            for v in values:
                per_pass, per_s = replay(rank, p12, rule, v, costs, accept)
                print(f"  {rule} {v:<4}: {per_pass:.2f} tokens a pass, {per_s:.2f} tokens/s")


def _ranks(a) -> dict:
    from flashllm.format.reader import open_flash
    from scripts.studies.draft_ranks import draft_ffn, held_out, ranks
    flash = open_flash(a.model)
    sub, data = draft_ffn(flash, a.hot, a.threads), {}
    for kind, ids in held_out(flash, a.positions):
        data[f"{kind}_rank"], data[f"{kind}_p"] = ranks(flash, sub, ids, a.threads)
    return data


if __name__ == "__main__":
    main()
