"""The sparse output head: when the head streams, its sketch (convert/head_sketch.py, a Q2_K copy,
0.4x the bytes of a Q6_K head) streams in its place and ranks the vocabulary, and only the rows
the sampler can keep are read from flash and multiplied exactly; every other logit is -inf. (A
resident sketch would save 0.4x the head's bytes a token but take as many from the neuron
caches, which then read them back: streamed, it takes none.)

For a hidden state x the sketch's logit s_r differs from the exact one by an error whose standard
deviation is sigma_r = sqrt(sum_b |x_b|^2 var_rb) (var: the sketch's mean squared error per
superblock, stored with it; held here in f16, scaled, rounded up). A few dims of x can carry much
of its energy (massive activations: SmolLM2's largest dim holds ~46% of |x|^2), which would widen
every bound; so the dims of the first hidden state the head sees that hold at least EXACT_SHARE
of its energy (at most EXACT_DIMS) get their head columns in f16 (read once, from the whole head)
and leave the sketch's sum and sigma; the worst case of those columns' f16 rounding widens the
bound. With z = SIGMA_Z every exact logit is taken to lie in [s_r - z sigma_r, s_r + z sigma_r]
(fl_logit_bounds); the candidates are the rows whose upper end reaches the k-th largest lower end
(the top k the sampler keeps: k = 1 for greedy, top-k) or the largest lower end minus a margin
(min-p alone), and the recent tokens a repeat penalty changes. The bound is statistical, not a
proof: docs/PREDICTOR.md ("The sparse output head") measures how often it holds.
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
from flashllm.ffi.heap import trim_heap
from flashllm.format.layout import SKETCH, SKETCH_VAR
from flashllm.format.reader import FlashModel
from flashllm.model.tensor import QTensor
from flashllm.runtime.interfaces import ReadStream
from flashllm.runtime.weights import DenseWeights

SIGMA_Z = 5.0          # bound width in sigmas (measured: docs/PREDICTOR.md)
EXACT_DIMS = 8         # at most this many hidden dims get their head columns in f16 ...
EXACT_SHARE = 0.01     # ... each holding at least this share of the first hidden state's |x|^2
F16_EPS = 2.0 ** -11   # f16 rounding: |w16 - w| <= F16_EPS |w| + F16_TINY
F16_TINY = 2.0 ** -25
MAX_READ_SHARE = 0.5   # candidate pages above this share of the head's bytes: read it whole
ALLOWED_SHARE = 0.25   # a grammar's allowed rows up to this share of the sketch's bytes are
                       # read on their own, the sketch not at all (scattered rows read slower
                       # than the sketch's one sequential stream)
PAGE = 4096
HEAD_ROWS_READ = 2 << 20   # candidate rows a token reads, planned for a head calibration has not
                           # measured (greedy reads ~1 MB on the 1.5B, top-k 40 more)
MEASURED_TOPS = (1, 40)    # the samplers calibration measures: greedy, and `run`'s default top-k
MEASURE_CHUNK = 32     # positions measure_reads estimates at once: (32, vocab) f32 (19 MB
                       # on a 151,936-token vocabulary), then one position's bounds at a time
BOUNDS_ARRAYS = 4      # (vocab,) arrays alive while a position's candidates are found:
                       # its upper and lower ends, the partition's copy, the mask


@dataclass(frozen=True)
class HeadNeed:
    """Which logits a sampler reads: the `top` largest (0: none by rank), every one within
    `margin` of the largest (0: none by margin), and those of the last `recent` tokens fed
    (-1: all; a repeat penalty changes them); no_eog: ranked among the tokens that are not
    the model's end-of-generation ones (a sampler that never draws them: --ignore-eos)."""

    top: int = 1
    margin: float = 0.0
    recent: int = 0
    no_eog: bool = False


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


def sketch_bytes(manifest: dict, staging: int = 0, top: int = 1,
                 forced: bool = False) -> tuple[int, int]:
    """(DRAM a sparse head keeps: the sketch's error table, the exact columns, a position's
    temporaries and as much of `staging`, the reader's staging memory, as its candidate rows
    fill (a row is no whole page; unmeasured: all); bytes a token reads: the sketch, then the candidate rows or, for a
    fallback, the whole head), for a sampler keeping the `top` largest logits (0: by margin).
    The rows are what calibration measured (measure_reads); unmeasured, a head is planned only
    when forced, at HEAD_ROWS_READ. (0, 0): no sparse head."""
    tensors = {t["name"]: t for t in manifest["dense"]["tensors"]}
    if SKETCH not in tensors or SKETCH_VAR not in tensors:
        return 0, 0
    measured = (manifest.get("sparsity") or {}).get("head") or {}
    k = min((k for k in MEASURED_TOPS if k >= top > 0), default=0)    # a measured k as large
    rows = measured.get("greedy" if k == 1 else f"top{k}", {}).get("bytes")
    if rows is None and not forced:
        return 0, 0
    vocab = tensors[SKETCH]["shape"][0]
    work = BOUNDS_ARRAYS * vocab * 4                 # a position's (vocab,) f32 temporaries
    var = int(tensors[SKETCH_VAR]["nbytes"]) // 2    # the error table, f32 on file, f16 here
    fill = staging if rows is None else min(staging, int(rows))
    rows = HEAD_ROWS_READ if rows is None else int(rows)
    return var + vocab * EXACT_DIMS * 2 + work + fill, int(tensors[SKETCH]["nbytes"]) + rows


def measure_reads(flash: FlashModel, weights: DenseWeights, x: np.ndarray, n_threads: int = 1,
                  tops=MEASURED_TOPS) -> dict:
    """What a sparse head's candidates read a position on hidden states x (n, cols) (final,
    normalized: calibration text), for samplers keeping the top k of each of `tops`: {"greedy"
    or "top<k>": {"rows": mean candidate rows, "fallbacks": share of positions that read the
    whole head, "bytes": mean bytes read}} (the planner's estimate: sketch_bytes). weights: a
    dense model's DenseWeights (no reader: the sketch is read whole). The exact dims come from
    the middle position, as a run takes them from one."""
    head = SparseHead(flash, weights, HeadNeed(1), n_threads)
    head.exact_dims(x[len(x) // 2:len(x) // 2 + 1])
    seen = {k: [] for k in tops}                        # k -> [(rows, bytes)] per position
    for s0 in range(0, len(x), MEASURE_CHUNK):          # a chunk's estimates, then a position's
        s, xb, slack = head.estimate(x[s0:s0 + MEASURE_CHUNK])  # (C, vocab) (C, d_pad/256) (C,)
        for t in range(len(s)):
            hi, lo = head.bounds_of(s[t], xb[t], slack[t])              # (vocab,) each
            for k in tops:
                cand = head.candidates(hi, lo, HeadNeed(k))
                pages = head.pages_of(cand) * PAGE
                seen[k].append((len(cand), head.head_bytes
                                if pages > MAX_READ_SHARE * head.head_bytes else pages))
            del hi, lo
        del s
        trim_heap()                                     # the chunk's (C, vocab) estimate
    out = {}
    for k, v in seen.items():
        a = np.array(v, np.float64)                                       # (n, 2)
        out["greedy" if k == 1 else f"top{k}"] = {
            "rows": round(float(a[:, 0].mean()), 1), "bytes": int(a[:, 1].mean()),
            "fallbacks": round(float((a[:, 1] == head.head_bytes).mean()), 4)}
    return {"positions": len(x), **out}


class SparseHead:
    """The logits of a streamed head (DenseWeights `weights`, which reads its rows) over the
    candidates of `need`; full-head logits when the candidates cost too much. stream: a static
    pass's read stream carrying the sketch in the head's place (runtime/stream.py), else the
    weights read the sketch themselves."""

    def __init__(self, flash: FlashModel, weights: DenseWeights, need: HeadNeed, n_threads: int,
                 softcap: float = 0.0, z: float = SIGMA_Z, stream: Optional[ReadStream] = None):
        self.w, self.need, self.n_threads, self.z, self.cap = weights, need, n_threads, z, softcap
        self.stream = stream
        self.d_pad = flash.dense_entry(SKETCH)["shape"][1]
        self.sketch = flash.tensor(SKETCH) if weights.reader is None else None  # QTensor (vocab,
        # d_pad) in DRAM for a model without a reader; else streamed in chunks like the head
        var = flash.tensor(SKETCH_VAR).data.view(np.float32)             # (vocab, d_pad / 256)
        peak = float(var.max(initial=0.0))        # f16 keeps 11 bits from 2^-14 to 2^15: scale
        self.var_scale = 2.0 ** (14 - math.ceil(math.log2(peak))) if peak > 0 else 1.0  # into it
        self.var_t = _f16_up(var.T * np.float32(self.var_scale))         # (d_pad / 256, vocab)
        del var
        trim_heap()
        t = flash.dense_entry(weights.head_name)
        self.dtype, (self.vocab, self.cols) = t["dtype"], t["shape"]
        self.row_bytes, self.offset = t["nbytes"] // self.vocab, t["offset"]
        self.head_bytes = t["nbytes"]
        self.sketch_bytes = flash.dense_entry(SKETCH)["nbytes"]
        self.eog = np.asarray(flash.config.eos_token_ids, np.int64)     # (e,) never candidates
        self.dims = None           # (k,) the hidden dims whose columns are exact, from the first x
        self.columns = None        # (k, vocab) f16 those columns of the head
        self.col_max = None        # (k,) f32 the largest |value| of each
        self.tokens = self.rows = self.pages = self.fallbacks = 0
        self.allowed_only = 0      # rows whose allowed rows were read without the sketch ranking
                                   # them (in a pass that read none of it, or for other rows)
        self.sketch_read = 0       # bytes of the sketch read (streamed)
        self.sketch_s = self.exact_s = 0.0

    def logits(self, x: np.ndarray, recent: list[np.ndarray], exact: bool,
               allowed: Optional[list] = None) -> np.ndarray:
        """(T, vocab) f32 logits of x (T, cols): exact over the candidates, -inf elsewhere;
        recent[t] (n,) the tokens fed up to row t that a repeat penalty looks at. allowed[t]
        (vocab,) bool: a grammar's mask of row t (None: any token), every candidate within it;
        when reading all the allowed rows costs fewer bytes than the sketch, exactly those are
        read and the sketch is not (prepare told a read-ahead ring to skip it); else the sketch
        ranks only the rows that allow more tokens than the sampler keeps (ranked_candidates)."""
        T = len(x)
        if self.dims is None:
            self.exact_dims(x)
        t0 = time.perf_counter()
        cand = self.allowed_rows(allowed, recent)                         # (k,) or None
        if cand is not None:
            self.allowed_only += T
            if self._in_ring():                 # skipped (prepare), or read all the same
                drained = self.stream.drain_head()
                self.w.count(drained)
                self.sketch_read += drained.get("bytes_requested", 0)
        else:
            cand, unranked = self.ranked_candidates(x, allowed, recent)  # (k,), rows
            self.allowed_only += unranked
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
        s = np.full((T, self.vocab), -np.inf, np.float32)                # (T, vocab)
        s[:, cand] = kernel.matmul(rows, x, None, self.n_threads, exact)  # (T, k)
        self.exact_s += time.perf_counter() - t1
        self.rows, self.pages = self.rows + len(cand), self.pages + pages
        return s

    def ranked_candidates(self, x: np.ndarray, allowed: Optional[list],
                          recent: list) -> tuple[np.ndarray, int]:
        """(the candidate ids (k,) of a pass whose rows x (T, cols) the sketch ranks, how many
        rows it did not rank). A row whose grammar allows no more tokens than the sampler keeps
        (a forced token, a digit under top-k) has them all as candidates whatever the sketch
        says: they are read, and the sketch's estimate and bounds run only for the other rows
        (the sketch itself is read once for the pass all the same)."""
        ranked = self.ranked_rows(allowed, len(x))                       # (T,) bool
        rows = np.flatnonzero(ranked)                                     # (T',)
        fixed = [np.flatnonzero(allowed[t]) for t in np.flatnonzero(~ranked)]   # each (n_t,)
        read0 = self.w.bytes_read
        s, xb, slack = self.estimate(x if len(rows) == len(x) else x[rows])  # (T', vocab)
        self.sketch_read += self.w.bytes_read - read0               # (T', d_pad / 256) (T',)
        cand = np.unique(np.concatenate(
            [self.candidates(*self.bounds_of(s[i], xb[i], slack[i]),
                             allowed=None if allowed is None else allowed[t])
             for i, t in enumerate(rows)] + fixed + [self._recent(r, allowed) for r in recent]))
        return cand, len(fixed)                                           # (k,)

    def ranked_rows(self, allowed: Optional[list], T: int) -> np.ndarray:
        """(T,) bool: which rows of a pass of T the sketch must rank: all, but those whose mask
        allows at most max(top, 1) tokens (every one of them is a candidate)."""
        if allowed is None:
            return np.ones(T, bool)
        most = max(self.need.top, 1)
        return np.array([np.count_nonzero(a) > most for a in allowed], bool)

    def prepare(self, allowed: Optional[list]) -> None:
        """Before a pass whose rows a grammar masks (allowed, as logits'): when only the allowed
        rows will be read, the read-ahead ring carrying the sketch skips its extents."""
        if self._in_ring() and self.allowed_rows(allowed, []) is not None:
            self.stream.skip_head(SKETCH)

    def _in_ring(self) -> bool:
        return self.stream is not None and self.stream.head_chunks(SKETCH) is not None

    def allowed_rows(self, allowed: Optional[list], recent: list) -> Optional[np.ndarray]:
        """The ids (k,) of every row a grammar allows in any of a pass's rows, when reading them
        costs fewer bytes than ALLOWED_SHARE of the sketch, or when no row needs the sketch to
        rank them (ranked_rows); else None (the sketch ranks them). recent: as logits' (the
        penalty's tokens; those the grammar allows are read too)."""
        if allowed is None:
            return None
        union = np.logical_or.reduce(allowed)                            # (vocab,)
        most = ALLOWED_SHARE * self.sketch_bytes
        ranks = self.ranked_rows(allowed, len(allowed)).any()
        if ranks and np.count_nonzero(union) * self.row_bytes >= most:
            return None
        rows = np.unique(np.concatenate([np.flatnonzero(union)] +
                                        [self._recent(r, allowed) for r in recent]))  # (k,)
        return rows if not ranks or self.pages_of(rows) * PAGE < most else None

    @staticmethod
    def _recent(tokens, allowed: Optional[list]) -> np.ndarray:
        """The recent tokens (n,) a penalty changes, those some row allows when a grammar
        masks them (a forbidden token's logit is -inf whatever it is)."""
        r = np.asarray(tokens, np.int64)                                 # (n,)
        return r if allowed is None else r[np.logical_or.reduce(allowed)[r]]

    def exact_dims(self, x: np.ndarray, most: int = EXACT_DIMS, share: float = EXACT_SHARE):
        """Choose the dims that hold at least `share` of hidden states x's (T, cols) energy (a
        run: the prompt's last position), at most `most`, and read their head columns."""
        energy = (x.astype(np.float64) ** 2).sum(axis=0)                 # (cols,)
        top = np.argsort(-energy)[:min(most, len(energy))]               # (most,)
        self.dims = np.sort(top[energy[top] >= share * energy.sum()])    # (k,)
        self.columns, self.col_max = self.w.head_columns(self.dims)      # (k, vocab) f16, (k,)
        trim_heap()                         # the read's temporaries: no plan counts them

    def estimate(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For x (T, cols): the sketch's logits with the exact dims' columns added (T, vocab),
        each position's energy per superblock left to the sketch (T, d_pad / 256), and the
        worst case of the f16 columns' rounding (T,)."""
        xp = np.zeros((len(x), self.d_pad), np.float32)                  # (T, d_pad)
        xp[:, :x.shape[1]] = x
        xk = xp[:, self.dims].copy()                                      # (T, k)
        xp[:, self.dims] = 0.0
        s = self._sketch_logits(xp)                                       # (T, vocab)
        col, prod = np.empty((2, self.vocab), np.float32)                 # (vocab,) each
        for j in range(len(self.dims)):    # k axpys a row at a time: no (T, vocab) temporary
            np.copyto(col, self.columns[j])
            for t in range(len(s)):
                s[t] += np.multiply(xk[t, j], col, out=prod)
        xb = (xp * xp).reshape(len(x), -1, 256).sum(axis=2)              # (T, d_pad / 256)
        xb /= np.float32(self.var_scale)                  # var_t holds var * var_scale
        slack = np.abs(xk) @ (self.col_max * F16_EPS + F16_TINY)         # (T,)
        return s, xb, slack.astype(np.float32)

    def bounds_of(self, s: np.ndarray, xb: np.ndarray,
                  slack: float) -> tuple[np.ndarray, np.ndarray]:
        """(upper, lower) (vocab,) f32 ends of one position's exact logits, after the final
        softcap, from its estimate s (vocab,), energies xb (d_pad / 256,) and f16 slack: s +-
        (z sigma + slack)."""
        hi, lo = kernel.logit_bounds(s, self.var_t, xb, self.z, slack)    # (vocab,) each
        if self.cap:                                                      # tanh is monotonic
            for v in (hi, lo):
                v /= np.float32(self.cap)
                np.tanh(v, out=v)
                v *= np.float32(self.cap)
        return hi, lo

    def bounds(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(upper, lower) (T, vocab) f32 ends of every exact logit of x (T, cols): bounds_of
        every position (studies and tests; a run takes one position at a time)."""
        s, xb, slack = self.estimate(x)
        ends = [self.bounds_of(s[t], xb[t], slack[t]) for t in range(len(x))]
        return np.stack([e[0] for e in ends]), np.stack([e[1] for e in ends])

    def _sketch_logits(self, xp: np.ndarray) -> np.ndarray:
        """(T, vocab) sketch . xp for xp (T, d_pad): resident, or streamed chunk by chunk by the
        dense weights (which count its reads)."""
        if self.sketch is not None:
            return kernel.matmul(self.sketch, xp, None, self.n_threads)  # (T, vocab)
        chunks = self.stream.head_chunks(SKETCH) if self.stream is not None else None
        return self.w.sketch_output(xp, chunks)                           # (T, vocab)

    def candidates(self, hi: np.ndarray, lo: np.ndarray, need: Optional[HeadNeed] = None,
                   allowed: Optional[np.ndarray] = None):
        """Row ids (k,) whose exact logit may be one the sampler keeps (need, default the
        head's), from one position's bounds hi, lo (vocab,); among allowed (vocab,) bool when
        a grammar masks the row (the top k and the margin then count allowed rows only)."""
        need = need or self.need
        if allowed is not None:
            lo = np.where(allowed, lo, -np.inf).astype(np.float32)        # (vocab,)
        if need.no_eog and len(self.eog):         # ranked without them, and none of them kept
            hi, lo = hi.copy(), lo.copy()
            hi[self.eog] = lo[self.eog] = -np.inf
        keep = np.zeros(self.vocab, bool)                                 # (vocab,)
        if need.top:
            k = min(need.top, self.vocab)
            keep |= hi >= np.partition(lo, self.vocab - k)[self.vocab - k]
        if need.margin:
            keep |= hi >= lo.max() - np.float32(need.margin)
        if allowed is not None:
            keep &= allowed
        return np.flatnonzero(keep)

    def pages_of(self, rows: np.ndarray) -> int:
        """4 KiB pages of the head the rows (k,) touch."""
        first = (self.offset + rows * self.row_bytes) // PAGE             # (k,)
        last = (self.offset + rows * self.row_bytes + self.row_bytes - 1) // PAGE
        return int(len(np.unique(np.concatenate([first, last]))) +
                   np.sum(np.maximum(last - first - 1, 0)))

    def stats(self) -> dict:
        return {"head_tokens": self.tokens, "head_rows": self.rows, "head_pages": self.pages,
                "head_fallbacks": self.fallbacks, "head_allowed_only": self.allowed_only,
                "head_sketch_bytes": self.sketch_read,
                "head_sketch_s": self.sketch_s,
                "head_exact_s": self.exact_s}


def _f16_up(a: np.ndarray) -> np.ndarray:
    """a (any shape, f32 >= 0) as f16, each value rounded up (a bound stays a bound)."""
    h = np.ascontiguousarray(a, dtype=np.float16)
    low = h.astype(np.float32) < a
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h
