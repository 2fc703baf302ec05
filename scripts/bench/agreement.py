"""flashllm's next-token agreement with llama.cpp after every prefix of held-out text.

Run:  python -m scripts.bench.agreement MODEL FIXTURE [--margin 0.2] [--exact] [--kv f16|f32]
MODEL: a flashllm conversion of the fixture's GGUF; FIXTURE: an .npz made by
scripts/fixtures/make_llamacpp_agreement_fixture.py (llama.cpp's top tokens after each prefix,
each chunk in one batch). flashllm runs each chunk in one pass (as `run` prefills, f16 KV) and
its best token after every prefix is compared with llama.cpp's where llama.cpp's top-2 margin
exceeds --margin (below it the two orders are a coin flip for either implementation). Prints
one JSON line: agree / decided (and the rate), the same over all prefixes, and the prefixes
where they part (chunk, position, llama.cpp's margin, flashllm's margin between the two).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from flashllm.format.reader import open_flash
from flashllm.runtime.model import Model


def agreement(ours: np.ndarray, our_margin: np.ndarray, top_ids: np.ndarray,
              top_logits: np.ndarray, margin: float) -> dict:
    """Counts of flashllm's best ids (P,) against llama.cpp's top ids / logits (P, k) after the
    same P prefixes, where llama.cpp's top-2 margin > margin and over all of them; our_margin
    (P,): flashllm's logit of llama.cpp's first minus its second (negative where they part)."""
    same = ours == top_ids[:, 0]                                             # (P,) bool
    ref_margin = top_logits[:, 0] - top_logits[:, 1]                         # (P,)
    clear = ref_margin > margin                                              # (P,) bool
    parted = np.flatnonzero(clear & ~same)
    return {"agree": int((same & clear).sum()), "decided": int(clear.sum()),
            "agree_all": int(same.sum()), "all": int(len(same)),
            "parted": [{"row": int(p), "llama_margin": round(float(ref_margin[p]), 3),
                        "our_margin": round(float(our_margin[p]), 3)} for p in parted]}


def predictions(net: Model, ids: np.ndarray, top_ids: np.ndarray,
                piece: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """flashllm's best id (P,) after every prefix of each chunk of ids (chunks, n_ctx), a chunk
    from an empty cache in passes of `piece` tokens (a pass's logits are (piece, vocab)), and
    its logit of top_ids[:, 0] minus that of top_ids[:, 1] (P,); P = chunks * n_ctx."""
    best, margin = [], []
    refs = top_ids.reshape(len(ids), ids.shape[1], -1)                       # (chunks, n_ctx, k)
    for chunk, ref in zip(ids, refs):
        net.reset()
        for a in range(0, len(chunk), piece):
            z = net.forward(chunk[a:a + piece], a)                           # (piece, vocab)
            rows = np.arange(len(z))
            best.append(z.argmax(axis=1))
            margin.append(z[rows, ref[a:a + piece, 0]] - z[rows, ref[a:a + piece, 1]])
    return np.concatenate(best), np.concatenate(margin)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("fixture", type=Path)
    ap.add_argument("--margin", type=float, default=0.2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--exact", action="store_true", help="f32 activations (no int8 rounding)")
    ap.add_argument("--kv", choices=["f16", "f32"], default="f16")
    ap.add_argument("--piece", type=int, default=128, help="tokens a pass (memory: x vocab x 4 B)")
    args = ap.parse_args()
    fx = np.load(args.fixture, allow_pickle=False)
    ids = fx["ids"]                                                          # (chunks, n_ctx)
    net = Model(open_flash(args.model), n_threads=args.threads, n_ctx=ids.shape[1],
                exact=args.exact, kv_dtype=args.kv)
    k = fx["top_ids"].shape[-1]
    top_ids, top_logits = fx["top_ids"].reshape(-1, k), fx["top_logits"].reshape(-1, k)  # (P, k)
    ours, our_margin = predictions(net, ids, top_ids, args.piece)            # (P,) each
    got = agreement(ours, our_margin, top_ids, top_logits, args.margin)
    print(json.dumps({"model": str(args.model), "fixture": str(args.fixture),
                      "margin": args.margin, "rate": got["agree"] / max(got["decided"], 1),
                      **got}))


if __name__ == "__main__":
    main()
