"""The resident sub-network: the model computed from what is in DRAM alone — the draft of
self-speculative decoding (generation/self_draft.py).

Under a DRAM budget the neuron caches hold each layer's neurons of largest contribution (hot-first
order after `calibrate`), the attention stays resident, and the output head either stays resident
or streams. The resident model is the same Model (same KV cache) with

    FFN      each layer's cached neurons only (SparseFlashFfn.resident): no read
    head     the resident head; or, when it streams, its rows for a candidate set of tokens
             (HeadRows: the first `n_rows` ids — a byte-level BPE numbers its tokens in merge
             order, most frequent first — plus every token the context has used), read once
             into DRAM; the other tokens' logits are -inf

so a draft token reads nothing from flash (but its embedding row when the embeddings stream,
and the head row of a token the context meets for the first time). Its keys and values enter
the shared KV cache at speculative positions; the verifying pass writes those positions again,
so a rejected guess leaves nothing behind (the cache holds each position's last write, and
attention reads only positions up to its own).
"""
from __future__ import annotations

from typing import Iterable, Optional

import numpy as np

from flashllm.errors import FlashError
from flashllm.ffi import kernel
from flashllm.model.tensor import QTensor
from flashllm.runtime.budget import head_name


class ResidentError(FlashError):
    """A model whose resident part cannot make a draft (streamed attention, no caches)."""


class ResidentFfn:
    """The FFN strategy of the resident model: each layer over its neuron cache's rows only."""

    def __init__(self, sparse):
        self.sparse = sparse          # a SparseFlashFfn (its caches and kernel arguments)

    def start_pass(self, n_tokens: int, prefill: bool) -> None:
        pass

    def __call__(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        self.sparse.resident(layer, h, x)                                # x (T, d) += FFN(h)

    def stats(self) -> dict:
        return {}


class HeadRows:
    """Rows of a streamed output head for a growing set of token ids, in DRAM: logits (T, vocab)
    over them (-inf elsewhere). Capacity: n_rows + the context's tokens."""

    def __init__(self, weights, n_rows: int, n_ctx: int):
        t = weights.flash.dense_entry(weights.head_name)
        self.weights, self.name, self.dtype = weights, weights.head_name, t["dtype"]
        self.vocab, self.cols = t["shape"]
        self.rb = t["nbytes"] // self.vocab
        cap = min(self.vocab, n_rows + n_ctx)
        self.data = np.empty((cap, self.rb), dtype=np.uint8)             # (cap, row bytes)
        self.ids = np.zeros(cap, dtype=np.int64)                         # (cap,) token of a row
        self.have = np.zeros(self.vocab, dtype=bool)                     # (vocab,)
        self.n = 0
        self.add(np.arange(min(n_rows, self.vocab)))

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.ids.nbytes + self.have.nbytes

    def add(self, tokens: Iterable[int]) -> None:
        """Read the rows of tokens not held yet (as many as fit)."""
        new = np.unique(np.fromiter(tokens, dtype=np.int64))              # (k,)
        new = new[(new >= 0) & (new < self.vocab)]
        new = new[~self.have[new]][:len(self.data) - self.n]
        if len(new):
            self.weights.read_rows(self.name, new, self.data[self.n:self.n + len(new)])
            self.ids[self.n:self.n + len(new)] = new
            self.have[new] = True
            self.n += len(new)

    def logits(self, x: np.ndarray, n_threads: int, exact: bool) -> np.ndarray:
        """(T, vocab) f32: the held rows' logits of x (T, cols), -inf elsewhere."""
        w = QTensor(self.data[:self.n], self.dtype, self.n, self.cols)
        out = np.full((len(x), self.vocab), -np.inf, dtype=np.float32)   # (T, vocab)
        out[:, self.ids[:self.n]] = kernel.matmul(w, x, None, n_threads, exact)  # (T, n)
        return out


def head_rows_bytes(manifest: dict, n_rows: int, n_ctx: int) -> int:
    """DRAM of a HeadRows of n_rows + n_ctx rows (its maps included), from the manifest."""
    e = {t["name"]: t for t in manifest["dense"]["tensors"]}[head_name(manifest)]
    vocab = e["shape"][0]
    return min(vocab, n_rows + n_ctx) * (e["nbytes"] // vocab + 8) + vocab


class ResidentWeights:
    """The dense weights as the resident model sees them: the same embeddings, norms and resident
    attention; the output head resident, or a HeadRows."""

    def __init__(self, weights, head_rows: Optional[HeadRows] = None):
        streamed = weights.streamed_layers()
        if streamed:
            raise ResidentError(f"the resident model needs every layer's attention in DRAM; "
                                f"this budget streams {len(streamed)} layers' (raise --dram-budget)")
        if weights.head is None and head_rows is None:
            raise ResidentError("the output head streams: the resident model needs its rows")
        self.weights, self.head_rows = weights, head_rows
        self.pos_embd, self.proj_in, self.proj_out = weights.pos_embd, weights.proj_in, weights.proj_out
        self.out_norm, self.out_norm_b = weights.out_norm, weights.out_norm_b

    def see(self, tokens: Iterable[int]) -> None:
        """Tokens the context has used: their head rows are held from now on."""
        if self.head_rows is not None:
            self.head_rows.add(tokens)

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        return self.weights.embed(tokens)                                # (T, embed_dim)

    def layer(self, i: int):
        return self.weights.layers[i]

    def output(self, x: np.ndarray, exact: bool = False) -> np.ndarray:
        """(T, vocab) logits of x (T, embed_dim): the resident head's, or the held rows'."""
        w = self.weights
        if self.head_rows is None:
            return kernel.matmul(w.head, x, None, w.n_threads, exact)      # (T, vocab)
        return self.head_rows.logits(x, w.n_threads, exact)


def resident_model(model, head_rows: int = 0):
    """The resident sub-network of model (a Model over a SparseFlashFfn): a Model sharing its
    KV cache; head_rows: the candidate rows to hold when the output head streams."""
    sparse = model.ffn
    if not hasattr(sparse, "resident") or not sparse.caches:
        raise ResidentError("self-speculation needs a model whose FFN streams from flash "
                            "(--dram-budget) with neuron caches")
    w = model.w
    rows = HeadRows(w, head_rows, model.n_ctx) if w.head is None else None
    return model.sibling(ResidentFfn(sparse), ResidentWeights(w, rows))
