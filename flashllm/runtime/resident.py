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
and the head row of a token the context meets for the first time). Where the caches hold at
least CARRY_MIN_SHARE of each layer's neurons, the draft's FFN also adds a share of what the
other (cold) neurons added at the latest verified position (ColdCarry), fitted per layer from
the verifying passes (docs/PREDICTOR.md, "Kept, where it is fitted to lend").
Its keys and values enter the shared KV cache at speculative positions; the verifying pass
writes those positions again, so a rejected guess leaves nothing behind (the cache holds each
position's last write, and attention reads only positions up to its own).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional

import numpy as np

from flashllm.errors import FlashError
from flashllm.ffi import kernel
from flashllm.model.tensor import QTensor
from flashllm.runtime.budget import head_name
from flashllm.runtime.interfaces import DenseSource, FfnStrategy
from flashllm.runtime.weights import DenseWeights

if TYPE_CHECKING:     # loaded by the run that builds one, not before its plan
    from flashllm.runtime.sparse_ffn import SparseFlashFfn


class ResidentError(FlashError):
    """A model whose resident part cannot make a draft (streamed attention, no caches)."""


CARRY_MIN_SHARE = 0.4   # a draft borrows where the caches hold at least this share of a layer
CARRY_ROWS = 8          # a verifying pass's first rows kept: its fed token and up to 7 guesses
CARRY_DECAY = 0.95      # the running sums alpha is fitted from forget this much a pass
CARRY_MIN_PAIRS = 8     # ... and lend nothing before they hold this many pairs of positions
CARRY_MAX = 0.5         # alpha = the fit, at most this (a whole previous output misleads)


class ColdCarry:
    """What each layer's cold neurons (those outside its cache) added at a verifying pass's
    positions, lent to the draft.

    The SparseFlashFfn records, per layer of a static pass, x after all its neurons minus x after
    the cached ones: a decode pass's first CARRY_ROWS rows (positions pos0 ..; sibling rows come
    after the chain's and are never asked for), a prefill's last row. The draft's FFN at position
    q adds alpha[layer] times the row of the latest recorded position before q (the verified
    token that precedes it; for later guesses the last verified one). alpha is each layer's
    least-squares fit of a position's cold output on the position's before (decayed sums over
    the pairs the passes record, clipped to [0, CARRY_MAX]): a model or a cache split whose
    adjacent cold outputs are not alike lends nothing. A pass's rows count once its last layer has
    recorded them.
    """

    def __init__(self, n_layers: int, d: int):
        self.rows = np.zeros((n_layers, CARRY_ROWS, d), np.float32)    # (n_layers, ROWS, d)
        self.first, self.n = 0, 0        # position of rows[:, 0]; rows valid (0: none)
        self.xy = np.zeros(n_layers)     # (n_layers,) decayed sums of <before, after> ...
        self.xx = np.zeros(n_layers)     # (n_layers,) ... and of |before|^2
        self.pairs = np.zeros(n_layers)  # (n_layers,) decayed count of pairs
        self.alpha = np.zeros(n_layers, np.float32)                      # (n_layers,)
        self._pending = (0, 0, False)    # the pass being recorded: (first, n, prefill)

    @staticmethod
    def nbytes(n_layers: int, d: int) -> int:
        return n_layers * CARRY_ROWS * d * 4

    def start_pass(self, n_tokens: int, prefill: bool, pos0: int) -> None:
        self._pending = (pos0 + n_tokens - 1, 1, True) if prefill else \
            (pos0, min(n_tokens, CARRY_ROWS), False)

    def record(self, layer: int, x: np.ndarray, x_hot: np.ndarray) -> None:
        """x (T, d) after the layer's whole FFN, x_hot (T, d) after its cached neurons."""
        first, n, prefill = self._pending
        cold = x[-1:] - x_hot[-1:] if prefill else x[:n] - x_hot[:n]     # (n, d)
        if not prefill:
            self._fit(layer, first, cold)
        self.rows[layer, :n] = cold
        if layer == len(self.rows) - 1:
            self.first, self.n = first, n

    def _fit(self, layer: int, first: int, cold: np.ndarray) -> None:
        """Add the pass's pairs of adjacent positions (the kept row before its first, then its
        own rows) to layer's sums and refit its alpha."""
        held = self.first <= first - 1 < self.first + self.n
        before = np.concatenate([self.rows[layer, first - 1 - self.first:first - self.first]
                                 if held else cold[:0], cold[:-1]])        # (m, d)
        after = cold[len(cold) - len(before):]                             # (m, d)
        self.xy[layer] = CARRY_DECAY * self.xy[layer] + float(np.sum(before * after))
        self.xx[layer] = CARRY_DECAY * self.xx[layer] + float(np.sum(before * before))
        self.pairs[layer] = CARRY_DECAY * self.pairs[layer] + len(before)
        fit = self.xy[layer] / self.xx[layer] if self.xx[layer] > 0 else 0.0
        self.alpha[layer] = min(max(fit, 0.0), CARRY_MAX) \
            if self.pairs[layer] >= CARRY_MIN_PAIRS else 0.0

    def lend(self, layer: int, q: int, x: np.ndarray) -> None:
        """x (T, d) += alpha * the cold output recorded latest before position q (none: none)."""
        if self.n and q > self.first and self.alpha[layer] > 0:
            x += self.alpha[layer] * self.rows[layer, min(q - 1 - self.first, self.n - 1)]


class SpanCarry:
    """Several streams' ColdCarry over one pass of their stacked rows (runtime/batch.py):
    spans [(carry or None, (a, e, pos0))], the stream's rows a .. e-1 standing at pos0 ..
    (a decode pass's chain first), each recorded as its own pass."""

    def __init__(self, spans: list):
        self.spans = [(c, a, e, p) for c, (a, e, p) in spans if c is not None]

    def start_pass(self, n_tokens: int, prefill: bool, pos0: int) -> None:
        for carry, a, e, p in self.spans:
            carry.start_pass(e - a, prefill, p)

    def record(self, layer: int, x: np.ndarray, x_hot: np.ndarray) -> None:
        """x (T, d), x_hot (T, d): the pass's rows of every stream."""
        for carry, a, e, _ in self.spans:
            carry.record(layer, x[a:e], x_hot[a:e])


class ResidentFfn(FfnStrategy):
    """The FFN strategy of the resident model: each layer over its neuron cache's rows only,
    plus what a ColdCarry lends."""

    def __init__(self, sparse: SparseFlashFfn, carry: Optional[ColdCarry] = None):
        self.sparse = sparse          # its caches and kernel arguments
        self.carry, self.pos0 = carry, 0

    def start_pass(self, n_tokens: int, prefill: bool, pos0: int = 0) -> None:
        self.pos0 = pos0

    def __call__(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        self.sparse.resident(layer, h, x)                                # x (T, d) += FFN(h)
        if self.carry is not None:
            self.carry.lend(layer, self.pos0, x)

    def stats(self) -> dict:
        return {}


class HeadRows:
    """Rows of a streamed output head for a growing set of token ids, in DRAM: logits (T, vocab)
    over them (-inf elsewhere). Capacity: n_rows + the context's tokens."""

    def __init__(self, weights: DenseWeights, n_rows: int, n_ctx: int):
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
    vocab, row = _head_row_bytes(manifest)
    return min(vocab, n_rows + n_ctx) * row + vocab


def head_rows_fit(manifest: dict, nbytes: int, n_ctx: int) -> int:
    """The most n_rows whose HeadRows (with n_ctx context rows) takes at most nbytes (may be
    negative: not even the context's fit)."""
    vocab, row = _head_row_bytes(manifest)
    return (nbytes - vocab) // row - n_ctx


def _head_row_bytes(manifest: dict) -> tuple[int, int]:
    """(vocab, DRAM of one held row: its bytes and its token id)."""
    e = {t["name"]: t for t in manifest["dense"]["tensors"]}[head_name(manifest)]
    vocab = e["shape"][0]
    return vocab, e["nbytes"] // vocab + 8


class ResidentWeights(DenseSource):
    """The dense weights as the resident model sees them: the same embeddings, norms and resident
    attention; the output head resident, or a HeadRows."""

    def __init__(self, weights: DenseWeights, head_rows: Optional[HeadRows] = None):
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

    resident_layer = layer          # every layer's attention is resident here (__init__)

    def output(self, x: np.ndarray, exact: bool = False) -> np.ndarray:
        """(T, vocab) logits of x (T, embed_dim): the resident head's, or the held rows'."""
        w = self.weights
        if self.head_rows is None:
            return kernel.matmul(w.head, x, None, w.n_threads, exact)      # (T, vocab)
        return self.head_rows.logits(x, w.n_threads, exact)


def resident_model(model, head_rows: int = 0):
    """The resident sub-network of model (a Model over a SparseFlashFfn): a Model sharing its
    KV cache; head_rows: the candidate rows to hold when the output head streams."""
    return stream_residents([model], head_rows, attach=True)[0]


def stream_residents(nets: list, head_rows: int = 0, attach: bool = False) -> list:
    """The resident sub-network of each of a server's streams (Models over one SparseFlashFfn,
    each its own KV cache: Model.new_stream), each its own ColdCarry, and one HeadRows of
    head_rows + every stream's context shared by all when the output head streams. attach:
    the FFN records its passes for the (one) carry; else the passes that carry several
    streams record each one's rows (runtime/batch.py)."""
    sparse = _sparse_of(nets[0])
    w = nets[0].w
    rows = HeadRows(w, head_rows, sum(n.n_ctx for n in nets)) if w.head is None else None
    return [net.sibling(ResidentFfn(sparse, _carry(sparse, attach)), ResidentWeights(w, rows))
            for net in nets]


def _sparse_of(model) -> SparseFlashFfn:
    """model's SparseFlashFfn; ResidentError when its FFN is not one with neuron caches."""
    from flashllm.runtime.sparse_ffn import SparseFlashFfn
    sparse = model.ffn
    if not isinstance(sparse, SparseFlashFfn) or not sparse.caches:
        raise ResidentError("self-speculation needs a model whose FFN streams from flash "
                            "(--dram-budget) with neuron caches")
    return sparse


def carries(cached: int, n_ff: int) -> bool:
    """Whether a draft over caches of `cached` of a layer's n_ff neurons borrows cold output."""
    return n_ff > cached >= CARRY_MIN_SHARE * n_ff


def carry_bytes(manifest: dict) -> int:
    """DRAM of a ColdCarry of the manifest's model."""
    c = manifest["config"]
    return ColdCarry.nbytes(c["n_layers"], c["d_model"])


def _carry(sparse: SparseFlashFfn, attach: bool = True) -> Optional[ColdCarry]:
    """A ColdCarry recording sparse's static passes (attach: set as the one it records for),
    where its caches hold CARRY_MIN_SHARE of every layer's neurons (below it the lent output
    misleads the draft: PREDICTOR.md)."""
    if sparse.naive or sparse.stream is None or \
            not carries(min(c.n_pinned for c in sparse.caches), sparse.f.n_ff):
        return None
    carry = ColdCarry(len(sparse.caches), sparse.d)
    if attach:
        sparse.carry = carry
    return carry
