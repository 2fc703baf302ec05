"""The sparse output head: when the head streams, its sketch (convert/head_sketch.py, a Q2_K copy,
0.4x the bytes of a Q6_K head) streams in its place and ranks the vocabulary, and only the rows
the sampler can keep are read from flash and multiplied exactly; every other logit is -inf. (A
resident sketch would save 0.4x the head's bytes a token but take as many from the neuron
caches, which then read them back: streamed, it takes none.)

For a hidden state x the sketch's logit s_r differs from the exact one by an error whose standard
deviation is sigma_r = sqrt(sum_b |x_b|^2 var_rb) (var: the sketch's mean squared error per
superblock, stored with it). A few dims of x can carry most of its energy (massive activations:
SmolLM2's largest dim holds ~46% of |x|^2), which would widen every bound; so the EXACT_DIMS dims
largest in the first hidden state the head sees get their head columns exact (read once, from
the whole head) and leave the sketch's sum and sigma. With z = SIGMA_Z every exact logit is
taken to lie in
[s_r - z sigma_r, s_r + z sigma_r]; the candidates are the rows whose upper end reaches the k-th
largest lower end (the top k the sampler keeps: k = 1 for greedy, top-k) or the largest lower end
minus a margin (min-p alone), and the recent tokens a repeat penalty changes. The bound is
statistical, not a proof: docs/PREDICTOR.md ("The sparse output head") measures how often it holds.
A token whose candidates would cost more than MAX_READ_SHARE of the head's bytes reads the whole
head (a fallback, counted). Perplexity never uses this (its model has no sparse head).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from flashllm.ffi import kernel
from flashllm.format.layout import SKETCH, SKETCH_VAR
from flashllm.model.tensor import QTensor

SIGMA_Z = 5.0          # bound width in sigmas (measured: docs/PREDICTOR.md)
EXACT_DIMS = 16        # hidden dims whose head columns are kept exact (f32): the largest |x_j|
MAX_READ_SHARE = 0.5   # candidate pages above this share of the head's bytes: read it whole
PAGE = 4096
BOUNDS_ARRAYS = 8      # (vocab,) f32 arrays alive at once while a token's bounds are computed


@dataclass(frozen=True)
class HeadNeed:
    """Which logits a sampler reads: the `top` largest (0: none by rank), every one within
    `margin` of the largest (0: none by margin), and those of the last `recent` tokens fed
    (-1: all; a repeat penalty changes them)."""

    top: int = 1
    margin: float = 0.0
    recent: int = 0


def head_need(params) -> Optional[HeadNeed]:
    """The HeadNeed of sampler params (generation/sampler.py), or None when the sampler may keep
    any token (temperature sampling with neither top-k nor min-p alone): the full head then."""
    recent = params.repeat_last_n if params.repeat_penalty != 1.0 else 0
    if params.temp <= 0:
        return HeadNeed(1, 0.0, recent)
    if params.top_k > 0:
        return HeadNeed(params.top_k, 0.0, recent)
    if params.top_p >= 1.0 and params.min_p > 0:
        return HeadNeed(0, -math.log(params.min_p), recent)
    return None


def sketch_bytes(manifest: dict) -> tuple[int, int]:
    """(DRAM a sparse head keeps: the sketch's error table and the exact columns, bytes of the
    sketch a token streams); (0, 0) when the conversion has no sketch."""
    tensors = {t["name"]: t for t in manifest["dense"]["tensors"]}
    if SKETCH not in tensors or SKETCH_VAR not in tensors:
        return 0, 0
    vocab = tensors[SKETCH]["shape"][0]
    work = BOUNDS_ARRAYS * vocab * 4                 # a decode token's (vocab,) f32 temporaries
    return int(tensors[SKETCH_VAR]["nbytes"]) + vocab * EXACT_DIMS * 4 + work, \
        int(tensors[SKETCH]["nbytes"])


class SparseHead:
    """The logits of a streamed head (DenseWeights `weights`, which reads its rows) over the
    candidates of `need`; full-head logits when the candidates cost too much."""

    def __init__(self, flash, weights, need: HeadNeed, n_threads: int, softcap: float = 0.0,
                 z: float = SIGMA_Z):
        self.w, self.need, self.n_threads, self.z, self.cap = weights, need, n_threads, z, softcap
        self.d_pad = flash.dense_entry(SKETCH)["shape"][1]
        self.sketch = flash.tensor(SKETCH) if weights.reader is None else None  # QTensor (vocab,
        # d_pad) in DRAM for a model without a reader; else streamed in chunks like the head
        var = flash.tensor(SKETCH_VAR).data.view(np.float32)             # (vocab, d_pad / 256)
        self.var_t = np.ascontiguousarray(var.T)                          # (d_pad / 256, vocab)
        t = flash.dense_entry(weights.head_name)
        self.dtype, (self.vocab, self.cols) = t["dtype"], t["shape"]
        self.row_bytes, self.offset = t["nbytes"] // self.vocab, t["offset"]
        self.head_bytes = t["nbytes"]
        self.dims = None           # (k,) the hidden dims whose columns are exact, from the first x
        self.columns = None        # (vocab, k) f32 those columns of the head
        self.tokens = self.rows = self.pages = self.fallbacks = 0
        self.sketch_s = self.exact_s = 0.0

    def logits(self, x: np.ndarray, recent: list[np.ndarray], exact: bool) -> np.ndarray:
        """(T, vocab) f32 logits of x (T, cols): exact over the candidates, -inf elsewhere;
        recent[t] (n,) the tokens fed up to row t that a repeat penalty looks at."""
        T = len(x)
        if self.dims is None:
            self.exact_dims(x)
        t0 = time.perf_counter()
        hi, lo = self.bounds(x)                                           # (T, vocab) each
        cand = np.unique(np.concatenate([self.candidates(hi[t], lo[t]) for t in range(T)]
                                        + [np.asarray(r, np.int64) for r in recent]))  # (k,)
        self.sketch_s += time.perf_counter() - t0
        self.tokens += T
        pages = self.pages_of(cand)
        if pages * PAGE > MAX_READ_SHARE * self.head_bytes or len(cand) == 0:
            self.fallbacks += T
            return self.w.output(x, exact)                               # (T, vocab)
        t1 = time.perf_counter()
        buf = np.empty((len(cand), self.row_bytes), np.uint8)            # (k, row_bytes)
        self.w.read_rows(self.w.head_name, cand, buf)
        rows = QTensor(buf, self.dtype, len(cand), self.cols)
        out = np.full((T, self.vocab), -np.inf, np.float32)              # (T, vocab)
        out[:, cand] = kernel.matmul(rows, x, None, self.n_threads, exact)  # (T, k)
        self.exact_s += time.perf_counter() - t1
        self.rows, self.pages = self.rows + len(cand), self.pages + pages
        return out

    def exact_dims(self, x: np.ndarray) -> None:
        """Choose the dims where hidden states x (T, cols) have the most energy and read their
        head columns (a run: the prompt's last position)."""
        energy = (x.astype(np.float64) ** 2).sum(axis=0)                 # (cols,)
        self.dims = np.sort(np.argsort(-energy)[:min(EXACT_DIMS, len(energy))])  # (k,)
        self.columns = self.w.head_columns(self.dims)                    # (vocab, k)

    def bounds(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(upper, lower) (T, vocab) f32 ends of every exact logit of x (T, cols), after the
        final softcap: sketch + exact columns, +- z sigma."""
        xp = np.zeros((len(x), self.d_pad), np.float32)                  # (T, d_pad)
        xp[:, :x.shape[1]] = x
        xk = xp[:, self.dims].copy()                                      # (T, k)
        xp[:, self.dims] = 0.0
        s = self._sketch_logits(xp)                                       # (T, vocab)
        s += xk @ self.columns.T
        xb = (xp * xp).reshape(len(x), -1, 256).sum(axis=2)              # (T, d_pad / 256)
        dev = np.zeros((len(x), self.vocab), np.float32)                  # (T, vocab)
        for b in range(xb.shape[1]):      # a few axpys: numpy's skinny matmul is ~10x slower
            dev += xb[:, b:b + 1] * self.var_t[b]
        dev = np.sqrt(dev) * np.float32(self.z)                           # (T, vocab)
        hi, lo = s + dev, s - dev
        if self.cap:                                                      # tanh is monotonic
            hi, lo = (np.tanh(v / np.float32(self.cap)) * np.float32(self.cap) for v in (hi, lo))
        return hi, lo

    def _sketch_logits(self, xp: np.ndarray) -> np.ndarray:
        """(T, vocab) sketch . xp for xp (T, d_pad): resident, or streamed chunk by chunk by the
        dense weights (which count its reads)."""
        if self.sketch is not None:
            return kernel.matmul(self.sketch, xp, None, self.n_threads)  # (T, vocab)
        return self.w.sketch_output(xp)                                   # (T, vocab)

    def candidates(self, hi: np.ndarray, lo: np.ndarray, need: Optional[HeadNeed] = None):
        """Row ids (k,) whose exact logit may be one the sampler keeps (need, default the
        head's), from one position's bounds hi, lo (vocab,)."""
        need = need or self.need
        keep = np.zeros(self.vocab, bool)                                 # (vocab,)
        if need.top:
            k = min(need.top, self.vocab)
            keep |= hi >= np.partition(lo, self.vocab - k)[self.vocab - k]
        if need.margin:
            keep |= hi >= lo.max() - np.float32(need.margin)
        return np.flatnonzero(keep)

    def pages_of(self, rows: np.ndarray) -> int:
        """4 KiB pages of the head the rows (k,) touch."""
        first = (self.offset + rows * self.row_bytes) // PAGE             # (k,)
        last = (self.offset + rows * self.row_bytes + self.row_bytes - 1) // PAGE
        return int(len(np.unique(np.concatenate([first, last]))) +
                   np.sum(np.maximum(last - first - 1, 0)))

    def stats(self) -> dict:
        return {"head_tokens": self.tokens, "head_rows": self.rows, "head_pages": self.pages,
                "head_fallbacks": self.fallbacks, "head_sketch_s": self.sketch_s,
                "head_exact_s": self.exact_s}

