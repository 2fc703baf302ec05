"""Token logprobs (OpenAI's `logprobs` / `top_logprobs`): each token's log-probability and the
k most likely tokens at its place, from the distribution the sampler's chain starts from: the
model's logits with the penalties applied and, under a grammar (response_format, a forced tool
call), the tokens it forbids left out, at temperature 1, before top-k / top-p / min-p. So greedy
requests get the model's own numbers, and the sampled token's logprob never is -inf.

entry(...) is computed on the model's thread (serve/worker.py); chat_logprobs and
completion_logprobs shape the entries as OpenAI's chat and completions responses carry them.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def token_text(tok, token: int) -> tuple[str, list]:
    """A token's text and its UTF-8 bytes; a token that is no whole character (a byte-level
    piece) is written "bytes:\\xNN..." as OpenAI writes it."""
    if tok.table is not None:
        raw = tok.table.bytes_of([token], skip_special=False)
    else:
        raw = tok.decode([token], skip_special=False).encode("utf-8")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text, list(raw)


def entry(sampler, tok, logits: np.ndarray, history: Sequence[int], token: int, k: int) -> dict:
    """The logprobs of token, sampled from logits (vocab,) after history, and the k most likely
    tokens there: {"token", "bytes", "logprob", "top": [(token, bytes, logprob)]}."""
    scores = np.asarray(sampler.penalized(logits, history), dtype=np.float64)   # (vocab,)
    top = float(scores.max())
    lse = top + float(np.log(np.exp(scores - top).sum()))        # -inf rows add 0
    best = np.argpartition(-scores, k)[:k] if 0 < k < len(scores) else \
        np.arange(len(scores))[:k]                                # (k,)
    best = best[np.argsort(-scores[best], kind="stable")]
    text, raw = token_text(tok, token)
    out = {"token": text, "bytes": raw, "logprob": _finite(scores[token] - lse), "top": []}
    for i in best:
        t, b = token_text(tok, int(i))
        out["top"].append((t, b, _finite(scores[i] - lse)))
    return out


def _finite(x: float) -> float:
    """JSON has no -inf: a token the distribution leaves out gets OpenAI's floor, -9999."""
    return float(x) if np.isfinite(x) else -9999.0


def chat_logprobs(entries: list) -> dict:
    """A chat choice's logprobs: {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}."""
    return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": b}
                                          for t, b, lp in e["top"]]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list, offset: int = 0) -> dict:
    """A completion choice's logprobs: tokens, token_logprobs, top_logprobs ({token: logprob}
    each) and text_offset (each token's start in the text, counted from offset)."""
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t: lp for t, _, lp in e["top"]} for e in entries],
            "text_offset": offsets}
