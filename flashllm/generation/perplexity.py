"""Perplexity by llama.cpp's definition (tools/perplexity/perplexity.cpp, `perplexity()`).

    tokens  = tokenize(text) with the model's special tokens (BOS when the vocabulary adds one)
    chunks  = n_chunk = len(tokens) // n_ctx consecutive windows of n_ctx tokens (or --chunks)
    each chunk runs from an empty KV cache; when the vocabulary adds BOS, the chunk's first
    token is replaced by BOS for the forward pass
    first   = n_ctx // 2: scored are the predictions made at positions first .. n_ctx-2 of the
    chunk, of tokens first+1 .. n_ctx-1 (n_ctx - first - 1 per chunk)
    NLL_i   = -log softmax(logits_i)[next token];  PPL = exp(mean NLL)
    ±       = PPL · sqrt((mean NLL² − mean NLL²) / (count − 1))   (llama.cpp's "+/-")

Differences: llama.cpp refuses a text shorter than 2·n_ctx tokens; this needs only n_ctx (one
chunk). The softmax runs in f64 (llama.cpp: expf in f32, summed in f64).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from flashllm.errors import FlashError


class PerplexityError(FlashError):
    """Perplexity cannot be measured as asked (text too short, bad context size)."""


@dataclass
class PerplexityResult:
    ppl: float
    ppl_err: float                 # llama.cpp's "+/-"
    mean_nll: float
    count: int                     # scored tokens
    n_chunks: int
    n_ctx: int
    running: list = field(default_factory=list)   # PPL after each chunk ([1]x,[2]y,... in llama.cpp)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        return (f"Final estimate: PPL = {self.ppl:.4f} +/- {self.ppl_err:.5f} "
                f"({self.count} tokens, {self.n_chunks} chunks of {self.n_ctx})")


def bos_to_add(tok, bos_token_id: Optional[int]) -> Optional[int]:
    """The BOS id when the tokenizer adds it to a text (llama_vocab_get_add_bos), else None."""
    if bos_token_id is None:
        return None
    with_special, plain = tok.encode("a", add_special=True), tok.encode("a", add_special=False)
    return bos_token_id if with_special[:1] == [bos_token_id] and plain[:1] != [bos_token_id] else None


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """(T,) f64 negative log-likelihood of targets (T,) under logits (T, vocab)."""
    z = logits.astype(np.float64)                                  # (T, vocab)
    m = z.max(axis=1, keepdims=True)                               # (T, 1)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))              # (T,)
    return lse - z[np.arange(len(targets)), targets]


def count_chunks(n_tokens: int, n_ctx: int, n_chunks: Optional[int]) -> int:
    """How many chunks of n_ctx a text of n_tokens gives (at most n_chunks); PerplexityError
    when not one (checked before a model of that context is made)."""
    if n_ctx < 4:
        raise PerplexityError(f"context size {n_ctx} is too small (at least 4)")
    n_max = n_tokens // n_ctx
    if n_max == 0:
        raise PerplexityError(f"the text has {n_tokens} tokens, one chunk needs {n_ctx} "
                              "(give a longer text or a smaller --ctx)")
    n = n_max if n_chunks is None else min(n_chunks, n_max)
    if n < 1:
        raise PerplexityError(f"--chunks must be at least 1, got {n_chunks}")
    return n


def chunks(tokens: Sequence[int], n_ctx: int, n_chunks: Optional[int],
           bos_id: Optional[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per chunk (model input (n_ctx,) with BOS in front when bos_id, original tokens (n_ctx,))."""
    ids = np.asarray(tokens, dtype=np.int32)                       # (N,)
    out = []
    for i in range(count_chunks(len(ids), n_ctx, n_chunks)):
        orig = ids[i * n_ctx:(i + 1) * n_ctx]                      # (n_ctx,)
        inp = orig.copy()                                          # (n_ctx,)
        if bos_id is not None:
            inp[0] = bos_id
        out.append((inp, orig))
    return out


Progress = Callable[[int, int], None]     # (tokens done, tokens in all chunks)


def chunk_nll(model, inp: np.ndarray, orig: np.ndarray,
              progress: Optional[Callable[[int], None]] = None) -> np.ndarray:
    """(n_ctx - first - 1,) NLL of one chunk from an empty context. The first half runs without
    keeping logits, so only (n_ctx - first, vocab) logits are held at once. progress(tokens of
    the chunk done) after each layer of each half, a layer's share of its half's tokens."""
    first = len(inp) // 2
    model.reset()
    model.forward(inp[:first], 0, last_only=True, progress=_share(progress, 0, first))
    logits = model.forward(inp[first:], first,                     # (n_ctx - first, vocab)
                           progress=_share(progress, first, len(inp) - first))
    return token_nll(logits[:-1], orig[first + 1:])


def _share(progress: Optional[Callable[[int], None]], start: int, n: int):
    """A forward pass's progress(layers done, n_layers) over n tokens after start, as tokens."""
    if progress is None:
        return None
    return lambda layer, n_layers: progress(start + n * layer // n_layers)


def perplexity(model, tokens: Sequence[int], n_ctx: int = 512, n_chunks: Optional[int] = None,
               bos_id: Optional[int] = None,
               on_chunk: Optional[Callable[[int, int, float], None]] = None,
               progress: Optional[Progress] = None) -> PerplexityResult:
    """llama.cpp perplexity of tokens under model (any FFN strategy); on_chunk(i, n, running
    PPL) after each chunk; progress(tokens done, tokens of all chunks): (0, total) before the
    first pass, then after each layer of each pass."""
    if n_ctx > model.n_ctx:
        raise PerplexityError(f"--ctx {n_ctx} exceeds the model's context buffer {model.n_ctx}")
    work = chunks(tokens, n_ctx, n_chunks, bos_id)
    total = len(work) * n_ctx
    if progress is not None:
        progress(0, total)
    t0 = time.perf_counter()
    nll = nll2 = 0.0
    count, running = 0, []
    for i, (inp, orig) in enumerate(work):
        at = None if progress is None else lambda k, at=i * n_ctx: progress(at + k, total)
        v = chunk_nll(model, inp, orig, at)                        # (n_ctx - first - 1,)
        nll += float(v.sum())
        nll2 += float((v * v).sum())
        count += len(v)
        running.append(math.exp(nll / count))
        if on_chunk:
            on_chunk(i + 1, len(work), running[-1])
    mean, mean2 = nll / count, nll2 / count
    ppl = math.exp(mean)
    var = mean2 - mean * mean
    err = ppl * math.sqrt(var / (count - 1)) if var > 0 and count > 1 else 0.0
    return PerplexityResult(ppl, err, mean, count, len(work), n_ctx, running,
                            time.perf_counter() - t0)
