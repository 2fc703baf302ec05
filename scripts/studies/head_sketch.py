"""Which resident sketch of the output head ranks the vocabulary well enough to read only candidate rows?

Run:  python -m scripts.studies.head_sketch MODEL [--tokens 1024] [--threads 2]
MODEL: a converted flash folder. Hidden states come from the dense model over the built-in evaluation
texts (code and prose, flashllm.sparsity.corpus); exact logits are x @ W.T with the head dequantized
to f32 by gguf-py. For each sketch: DRAM bytes, and over all positions the percentiles of the rank
(under the sketch) of the exact top-1 and of the last of the exact top-40, and of the error / its
predicted sigma (the per-logit bound the runtime would use). Prints one JSON line per sketch.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from flashllm.convert.head_sketch import q2k_rows
from flashllm.format.reader import open_flash
from flashllm.generation.tokenizer import Tokenizer
from flashllm.runtime.model import Model
from flashllm.sparsity.calibrate import text_tokens
from flashllm.sparsity.corpus import builtin_text


def head_f32(flash) -> np.ndarray:
    """(vocab, d) f32 head, dequantized by gguf-py."""
    name = "output.weight" if flash.has("output.weight") else "token_embd.weight"
    t = flash.tensor(name)
    raw = np.asarray(t.data).reshape(t.rows, -1)                         # (vocab, row bytes)
    qt = GGMLQuantizationType[t.dtype.upper()]
    return dequantize(raw, qt).reshape(t.rows, t.cols).astype(np.float32)


def hidden_states(flash, tokens: np.ndarray, threads: int) -> np.ndarray:
    """(T, d) normalized final hidden states of tokens (T,), in windows of 512."""
    net = Model(flash, n_threads=threads, n_ctx=512)
    got = []
    real = net.w.output
    net.w.output = lambda x, exact=False: (got.append(x.copy()), real(x[:1], exact))[1]
    for s in range(0, len(tokens), 512):
        net.reset()
        net.forward(tokens[s:s + 512], 0)
    return np.concatenate(got)                                           # (T, d)


def groupwise(w: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(dequantized sketch (n, d), per-group error norms^2 (n, d/group), bytes): asymmetric
    round-to-nearest with an f16 scale and min per group."""
    n, d = w.shape
    g = w.reshape(n, d // group, group)                                  # (n, G, group)
    lo, hi = g.min(axis=2, keepdims=True), g.max(axis=2, keepdims=True)
    s = (hi - lo) / (2 ** bits - 1) + 1e-12
    q = np.clip(np.round((g - lo) / s), 0, 2 ** bits - 1) * s + lo
    e2 = ((q - g) ** 2).sum(axis=2)                                      # (n, G)
    return q.reshape(n, d).astype(np.float32), e2, n * d * bits // 8 + n * (d // group) * 4


def signs(w: np.ndarray, group: int, ternary: bool = False) -> tuple[np.ndarray, np.ndarray, int]:
    """(dequantized (n, d), error^2 per 256 (n, d/256), bytes) of a sub-2-bit copy: per group an f16
    mean m and scale a, each weight m +- a (sign bits; ternary: 0 too, for |w - m| under 0.7 of
    the group's mean |w - m|, stored as 2 bits)."""
    n, d = w.shape
    g = w.reshape(n, d // group, group)                                  # (n, G, group)
    m = g.mean(axis=2, keepdims=True)                                    # (n, G, 1)
    r = g - m                                                            # (n, G, group)
    keep = np.abs(r) > 0.7 * np.abs(r).mean(axis=2, keepdims=True) if ternary else \
        np.ones(r.shape, bool)                                           # (n, G, group)
    a = (np.abs(r) * keep).sum(axis=2, keepdims=True) / np.maximum(keep.sum(axis=2, keepdims=True), 1)
    q = m + a * np.sign(r) * keep                                        # (n, G, group)
    e2 = ((q - g) ** 2).reshape(n, d // 256, 256).sum(axis=2)            # (n, d/256)
    bits = 2 if ternary else 1
    return q.reshape(n, d).astype(np.float32), e2, n * d * bits // 8 + n * (d // group) * 4


def kquant2(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """The runtime's Q2_K sketch (convert/head_sketch.q2k_rows): (its values as gguf-py reads them
    (n, d), error^2 per 256 (n, d/256), bytes)."""
    data, var = q2k_rows(w)
    back = dequantize(data, GGMLQuantizationType.Q2_K).reshape(w.shape).astype(np.float32)
    return back, var * 256, data.nbytes


def lowrank(w: np.ndarray, basis: np.ndarray, r: int, bits: int):
    """(a (n, r) quantized coordinates, v (d, r), residual row norms^2 (n,), bytes)."""
    v = basis[:, :r]                                                     # (d, r)
    a = w @ v                                                            # (n, r)
    aq, _, nbytes = groupwise(a, bits, 32) if bits < 16 else (a, None, a.size * 2)
    res = w - aq @ v.T                                                   # (n, d)
    return aq, v, (res * res).sum(axis=1), nbytes + v.size * 4


def evaluate(name, approx, exact, sigma, nbytes) -> dict:
    """approx, exact, sigma: (T, vocab)."""
    T = len(exact)
    top = np.argsort(-exact, axis=1)[:, :40]                             # (T, 40)
    order = np.argsort(-approx, axis=1)                                  # (T, vocab)
    rank = np.empty_like(order)
    rank[np.arange(T)[:, None], order] = np.arange(order.shape[1])[None, :]
    r1 = rank[np.arange(T), top[:, 0]]                                   # (T,)
    r40 = rank[np.arange(T)[:, None], top].max(axis=1)                   # (T,)
    z = np.abs(approx - exact) / sigma                                   # (T, vocab)
    pct = lambda a: [int(np.percentile(a, p)) for p in (50, 90, 99, 100)]  # noqa: E731
    out = {"sketch": name, "MB": round(nbytes / 1e6, 1), "rank_top1_p50_90_99_max": pct(r1),
           "rank_top40_p50_90_99_max": pct(r40), "z_max": float(z.max()),
           "z_p99.99": float(np.percentile(z, 99.99))}
    for zb in (4.0, 5.0, 6.0):
        lo = (approx - zb * sigma).max(axis=1, keepdims=True)            # (T, 1)
        cand = (approx + zb * sigma) >= lo                               # (T, vocab)
        out[f"cands_greedy_z{zb:g}_p50_90_99_max_mean"] = pct(cand.sum(1)) + [int(cand.sum(1).mean())]
        out[f"top1_missed_z{zb:g}"] = int((~cand[np.arange(T), top[:, 0]]).sum())
        lo40 = -np.partition(-(approx - zb * sigma), 39, axis=1)[:, 39:40]  # (T, 1)
        c40 = (approx + zb * sigma) >= lo40                              # (T, vocab)
        out[f"cands_top40_z{zb:g}_p50_90_99_max_mean"] = pct(c40.sum(1)) + [int(c40.sum(1).mean())]
        out[f"top40_missed_z{zb:g}"] = int((~c40[np.arange(T)[:, None], top]).any(axis=1).sum())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    flash = open_flash(args.model)
    tok = Tokenizer.from_flash(flash)
    ids = [text_tokens(tok, builtin_text("evaluation", k, 40000).text, args.tokens // 2)
           for k in ("code", "prose")]
    x = hidden_states(flash, np.concatenate(ids).astype(np.int32), args.threads)  # (T, d)
    w = head_f32(flash)                                                  # (vocab, d)
    exact = x @ w.T                                                      # (T, vocab)
    xn2 = (x * x)                                                        # (T, d)
    q, e2, nb = kquant2(w)
    xb = xn2.reshape(len(x), -1, 256).sum(axis=2)                        # (T, d/256)
    sig = np.sqrt(xb @ (e2 / 256).T) + 1e-9                              # (T, vocab)
    print(json.dumps(evaluate("q2k", x @ q.T, exact, sig, nb)), flush=True)
    sig = np.sqrt(xn2.sum(1, keepdims=True) @ (e2.sum(1, keepdims=True) / w.shape[1]).T) + 1e-9
    print(json.dumps(evaluate("q2k_rowsigma", x @ q.T, exact, sig, nb)), flush=True)
    for bits, group in ((2, 32), (3, 64)):
        q, e2, nb = groupwise(w, bits, group)
        sig = np.sqrt(xn2.reshape(len(x), -1, group).sum(axis=2) @ (e2 / group).T) + 1e-9
        print(json.dumps(evaluate(f"q{bits}g{group}", x @ q.T, exact, sig, nb)), flush=True)
    xb = xn2.reshape(len(x), -1, 256).sum(axis=2)                        # (T, d/256)
    for name, (q, e2, nb) in (("sign_g256", signs(w, 256)), ("sign_g32", signs(w, 32)),
                              ("ternary_g32", signs(w, 32, ternary=True))):
        sig = np.sqrt(xb @ (e2 / 256).T) + 1e-9                          # (T, vocab)
        print(json.dumps(evaluate(name, x @ q.T, exact, sig, nb)), flush=True)
        del q, e2, sig
    if len(x):
        return
    _, vw = np.linalg.eigh(w.T.astype(np.float64) @ w)                   # (d, d) ascending
    basis = vw[:, ::-1].astype(np.float32)                               # (d, d)
    d = w.shape[1]
    for r, bits in ((128, 8), (256, 8), (256, 4), (384, 4), (512, 4)):
        a, v, res2, nb = lowrank(w, basis, r, bits)
        px = x @ v                                                       # (T, r)
        perp = np.sqrt(np.maximum((x * x).sum(1) - (px * px).sum(1), 0))  # (T,)
        sig = np.sqrt(res2)[None, :] * perp[:, None] / np.sqrt(d - r) + 1e-9
        print(json.dumps(evaluate(f"pca{r}_q{bits}", px @ a.T, exact, sig, nb)), flush=True)


if __name__ == "__main__":
    main()
