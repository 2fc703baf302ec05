"""The sparse flash FFN: per token, predictor → neuron cache → direct-I/O reads of the misses →
sparse FFN in C over the resident bundles, under the DRAM budget's plan (budget.py).

Decode (one token, or a token + draft guesses: their union), per layer:
    slots = predictor.predict(layer, h)          sorted int32 slots predicted active
    hits, misses = cache.lookup(slots)           rows already in DRAM / slots to read
    rows = cache.insert(misses)                  rows for the misses (evicting stale rows)
    read misses → rows   (a worker thread)   ‖   y += FFN over the hits (C kernel, no GIL)
    y += FFN over the new rows; misses the cache could not take stream through the staging buffer
Static passes: when every token needs the same slots 0 .. k-1 (predictor.AllSlots: no trained
predictor; or --naive, the paper's baseline, every bundle every token), every cache row is pinned
and the rest comes from the pass's read stream it is built with (runtime/stream.py: the
read-ahead through the staging memory cut into four page-aligned buffers, docs/ARCHITECTURE.md,
"The read-ahead"), which also carries streamed attention and a streamed output head.
With a predictor, a prefill (T > 1) reads each layer whole and sequentially through the staging
buffer's two halves (pinned rows come from the cache) and computes densely. Every path applies
the layer's calibrated magnitude threshold (manifest `sparsity.thresholds`, 0 when
absent). Predictors: sparsity.predictor.NeuronPredictor (predict(layer, h) -> sorted int32
slots, nbytes); an AllSlots promises slots 0 .. n_static-1 for every input (static_slots).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

from flashllm.ffi import kernel
from flashllm.ffi.reader import Reader, aligned_empty
from flashllm.format.reader import FlashModel
from flashllm.runtime.budget import BudgetPlan
from flashllm.runtime.ffn import bundle_ids, up_biases
from flashllm.runtime.ffn_reads import FfnReads
from flashllm.runtime.interfaces import FfnStrategy
from flashllm.runtime.neuron_cache import NeuronCache
from flashllm.runtime.stats import FlashStats, TokenStats
from flashllm.runtime.stream import PassStream
from flashllm.sparsity.activations import exact_active, manifest_thresholds
from flashllm.sparsity.predictor import AllSlots, NeuronPredictor
from flashllm.storage.costmodel import CostModel

clock = time.perf_counter
SERIAL_BYTES = 256 << 10       # an FFN call over fewer bundle bytes (x tokens) runs on one thread


def static_slots(predictor: NeuronPredictor, naive: bool, n_ff: int) -> Optional[int]:
    """k when every token needs slots 0 .. k-1 (--naive: all of them; an AllSlots: its
    n_static), else None (the predictor's slots depend on the token)."""
    if naive:
        return n_ff
    return predictor.n_static if isinstance(predictor, AllSlots) else None


def pinned_rows(plan: BudgetPlan, static: Optional[int]) -> int:
    """Rows each cache pins: every row a static pass can use (all its rows are read once),
    else the plan's hot rows."""
    return plan.n_pinned if static is None else min(plan.capacity, static)


class SparseFlashFfn(FfnStrategy):
    """An FFN strategy (flashllm/runtime/ffn.py) that streams bundles from ffn.bin through `reader`;
    a static pass's bundles past the pinned rows come from `stream` (pass_stream over the same
    reader: started here once the pinned rows are read; closed by close())."""

    def __init__(self, flash: FlashModel, predictor: NeuronPredictor, budget_plan: BudgetPlan,
                 reader: Reader, n_threads: int = 1, window: int = 4, naive: bool = False,
                 cost: Optional[CostModel] = None, check: bool = False, overlap: bool = True,
                 exact: bool = False, stream: Optional[PassStream] = None):
        cfg, f = flash.config, flash.ffn
        self.flash, self.f, self.predictor, self.reader = flash, f, predictor, reader
        self.d, self.glu, self.act, self.n_threads = cfg.d_model, cfg.glu, cfg.act, n_threads
        self.naive, self.check, self.plan, self.overlap = naive, check, budget_plan, overlap
        self.exact = exact            # f32 activations in the FFN instead of int8 (tests)
        self.ids = [bundle_ids(flash, i) for i in range(cfg.n_layers)]   # (n_ff,) int32 or None
        self.up_b = up_biases(flash)                                     # (n_ff,) f32 or None
        self.threshold = manifest_thresholds(flash.manifest, cfg.n_layers)
        self.static = static_slots(predictor, naive, f.n_ff)  # a static set: every cache row pinned
        pins = pinned_rows(budget_plan, self.static)
        if self.static is not None and stream is None and (naive or pins < self.static):
            raise ValueError("a static pass reads its uncached slots through a read stream "
                             "(runtime/stream.py pass_stream)")
        self.stream = stream
        rows = 2 * max(1, budget_plan.staging_rows // 2)                 # two halves
        self.staging = None if stream is not None else \
            aligned_empty(rows * f.stride).reshape(-1, f.stride)          # (rows, stride)
        # a half of the staging buffer in bytes: layer l sees it as rows of its own stride
        self._half_bytes = rows // 2 * f.stride
        self._ahead = None            # (layer, first chunk, half, read job) issued ahead
        cost = cost or CostModel.defaults()
        self.cost = cost
        self.reads = FfnReads(f, reader, cost)   # ffn.bin -> rows, counted in a token's stats
        self.caches = [] if naive else [
            NeuronCache(f.n_ff, budget_plan.capacity, f.strides[layer], window, pins)
            for layer in range(cfg.n_layers)]
        self.rec = FlashStats("naive" if naive else "sparse", {"summary": budget_plan.summary()})
        self._token: Optional[TokenStats] = None
        self.carry = None             # a ColdCarry (runtime/resident.py) a self draft borrows from
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="flashllm-read")
        for layer, cache in enumerate(self.caches):
            self.reads.read_seq(layer, cache.pin(), cache.matrix, None)
            if self.static is not None and 0 < pins == cache.capacity:   # rows that never change:
                cache.split(f.down_offset)                           # gate / up apart from down
        self._slots = np.arange(f.n_ff, dtype=np.int32)    # (n_ff,) sliced per chunk: no arange per token
        if stream is not None:        # the reader is the ring's alone from now on
            stream.start()

    # ---- the strategy seam -------------------------------------------------------------------

    def start_pass(self, n_tokens: int, prefill: bool, pos0: int = 0) -> None:
        self._token = self.rec.start("prefill" if prefill else "decode", n_tokens)
        if self.carry is not None:
            self.carry.start_pass(n_tokens, prefill, pos0)

    def __call__(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        if self.static is not None:
            self._static_pass(layer, h, x)
        elif len(h) == 1 or self._token.kind == "decode":   # a decode pass: + draft guesses
            self._decode(layer, h, x)
        else:
            self._whole_layer(layer, h, x)

    def resident(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        """x (T, d) += the FFN over the neurons in layer's cache only, no read and no stats: the
        resident sub-network's FFN (runtime/resident.py)."""
        cache = self.caches[layer] if self.caches else None
        if cache is not None:
            self._compute(layer, cache.matrix, self._slots[:cache.count], h, x, cache)

    def stats(self) -> dict:
        threads = self.reader.n_threads
        return {**self.rec.to_dict(lambda size: self.cost.gib_s(threads, max(size, 1.0))),
                "read_threads": threads}

    def forget_records(self) -> None:
        self.rec.tokens.clear()

    def close(self) -> None:
        """Stop reading ahead, close the readers (the FFN's and the stream's dense one)."""
        if self.stream is not None:
            self.stream.close()
        self._pool.shutdown(wait=True)
        self.reader.close()

    # ---- prefill and naive: whole layers ----------------------------------------------------

    def _whole_layer(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        """A prefill (T > 1) with a predictor: pinned rows from the cache, every other slot
        streamed in order; it also seeds the cache with what its last tokens predict (static
        passes, --naive included, read through the ring instead)."""
        cache = self.caches[layer]
        pinned = cache.n_pinned
        ahead = None if layer + 1 == len(self.ids) else layer + 1
        fill = self._seed(layer, cache, h)
        if pinned:
            t0 = clock()
            self._compute(layer, cache.matrix, np.arange(pinned, dtype=np.int32), h, x, cache)
            self._token.compute_s += clock() - t0
        if pinned < self.f.n_ff:
            self._stream(layer, np.arange(pinned, self.f.n_ff, dtype=np.int32), h, x, ahead, fill)

    def _seed(self, layer: int, cache: NeuronCache, h: np.ndarray):
        """Rows for the slots the prompt's last `window` tokens predict: (matrix, slots (k,),
        rows (k,)) for _stream to copy from staging as the slots pass by."""
        t0 = clock()
        slots = np.asarray(self.predictor.predict(layer, h[-cache.window:]), np.int32)  # (n,)
        cache.next_token()
        _, miss = cache.lookup(slots)                            # (m,)
        rows = cache.insert(miss)                                # (k,)
        self._token.mm_s += clock() - t0
        return cache.matrix, miss[:len(rows)], rows

    # ---- decode ------------------------------------------------------------------------------

    def _decode(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        t, cache = self._token, self.caches[layer]
        t0 = clock()
        slots = np.asarray(self.predictor.predict(layer, h), dtype=np.int32)  # (n,) sorted
        t1 = clock()
        cache.next_token()
        rows_hit, miss = cache.lookup(slots)                     # (h,) rows, (m,) slots
        rows_new = cache.insert(miss)                            # (k,) rows for miss[:k]
        fit, over = miss[:len(rows_new)], miss[len(rows_new):]   # (k,) cached, (m-k,) streamed
        t2 = clock()
        job = self._pool.submit(self.reads.read_rows, layer, fit, cache.matrix, rows_new, t) \
            if len(fit) else None
        waited = 0.0              # without overlap: the read finishes before the hits compute
        if job is not None and not self.overlap:
            job.result()
            waited = clock() - t2
        self._compute(layer, cache.matrix, rows_hit, h, x, cache)
        t3 = clock()
        if job is not None:
            job.result()
        t4 = clock()
        self._compute(layer, cache.matrix, rows_new, h, x, cache)
        t5 = clock()
        if len(over):
            self._stream(layer, over, h, x)
        t.predict_s += t1 - t0
        t.mm_s += t2 - t1
        t.io_s += (t4 - t3) + waited
        t.compute_s += (t3 - t2 - waited) + (t5 - t4)
        t.active += len(slots)
        t.hits += len(rows_hit)
        if self.check:
            self._check_recall(layer, h, slots, t)

    def _static_pass(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        """A pass (any T) when the slots are static: the pinned cache rows, then the layer's
        chunks from the read-ahead ring (already read, or in flight) as they come."""
        t, cache = self._token, None if self.naive else self.caches[layer]
        pinned = 0 if cache is None else cache.n_pinned
        t0 = clock()
        if pinned:
            self._compute(layer, cache.matrix, self._slots[:pinned], h, x, cache)
        t.compute_s += clock() - t0
        t.active += self.static
        t.hits += pinned
        x_hot = None if self.carry is None else x.copy()                  # (T, d) cached rows' sum
        stream = self.stream
        for j in range(0 if stream is None else stream.ffn_chunks(layer)):
            t0 = clock()
            first, rows, counters = stream.take_ffn(layer, j)              # (n, layer's stride)
            t1 = clock()
            n = len(rows)
            self._bundles(layer, rows, self._slots[first:first + n], h, x)
            stream.release()
            t.add_reads(counters)
            t.io_s += t1 - t0
            t.compute_s += clock() - t1
            t.streamed += n
        if x_hot is not None:
            self.carry.record(layer, x, x_hot)
        if self.check and len(h) == 1:
            self._check_recall(layer, h, self._slots[:self.static], t)

    def _compute(self, layer: int, matrix: np.ndarray, rows: np.ndarray, h: np.ndarray,
                 x: np.ndarray, cache: Optional[NeuronCache] = None) -> None:
        """x (T, d) += FFN over rows (k,) of matrix (n, stride); row i holds slot cache.slot_of[i]
        (or slot i without a cache)."""
        if len(rows) == 0:
            return
        slots = None                                             # (n,) slot of each row
        if self.up_b[layer] is not None:
            slots = np.maximum(cache.slot_of[:len(matrix)], 0) if cache is not None else \
                np.arange(len(matrix), dtype=np.int32)
        self._bundles(layer, matrix, slots, h, x, rows, None if cache is None else cache.down)

    def _bundles(self, layer: int, matrix: np.ndarray, slots: Optional[np.ndarray],
                 h: np.ndarray, x: np.ndarray, rows: Optional[np.ndarray] = None,
                 down: Optional[np.ndarray] = None) -> None:
        """x (T, d) += FFN over the bundles matrix (n, stride), or its rows (k,) when given;
        slots (n,): the slot each row holds (needed for an up bias only); down (n, its
        stride): the down columns when the matrix holds gate / up only (NeuronCache.split)."""
        ub, ids, order = self.up_b[layer], None, self.ids[layer]
        if ub is not None:
            ids = order[slots] if order is not None else slots   # (n,) neuron id of each row
        n = len(matrix) if rows is None else len(rows)
        kernel.ffn_bundles(matrix, self.f.dtype, self.d, self.glu, self.act, h, x, ids=ids,
                           up_bias=ub, n_threads=self._threads(n, len(h)), rows=rows,
                           threshold=self.threshold[layer], exact=self.exact,
                           down_dtype=self.f.down_dtypes[layer], down=down)

    def _threads(self, n_rows: int, T: int) -> int:
        """Threads for an FFN call over n_rows bundles of T tokens: one below SERIAL_BYTES of
        bundles per token (waking a sleeping thread costs more than the work)."""
        return 1 if n_rows * self.f.stride * T < SERIAL_BYTES else self.n_threads

    # ---- reads -------------------------------------------------------------------------------

    def _stream(self, layer: int, slots: np.ndarray, h: np.ndarray, x: np.ndarray,
                 ahead: Optional[int] = None, fill=None) -> None:
        """x += FFN over slots (m,) read through the staging buffer's two halves: chunk c+1 is
        read while chunk c computes. ahead: a layer whose first chunk (same slots) to read while
        the last chunk computes (the next layer of a prefill). fill: (matrix, slots, rows) to
        copy into the cache as they pass (consecutive chunks only)."""
        t, step = self._token, len(self._half(layer, 0))
        chunks = [slots[c:c + step] for c in range(0, len(slots), step)]   # each (k,)
        job, half = self._take_ahead(layer, chunks[0])
        if job is None:
            job = self._pool.submit(self._read_chunk, layer, chunks[0], half, t)
        for i, chunk in enumerate(chunks):
            t0 = clock()
            job.result()
            t1 = clock()
            if i + 1 < len(chunks):
                job = self._pool.submit(self._read_chunk, layer, chunks[i + 1], 1 - half, t)
            elif ahead is not None:       # its first chunk, as many rows as its stride fits
                first = chunks[0][:len(self._half(ahead, 0))]
                self._ahead = (ahead, first, 1 - half,
                               self._pool.submit(self._read_chunk, ahead, first, 1 - half, t))
            self._compute_staged(layer, chunk, half, h, x)
            if fill is not None:
                self._fill(layer, fill, chunk, half)
            t.io_s += t1 - t0
            t.compute_s += clock() - t1
            t.streamed += len(chunk)
            half = 1 - half

    def _fill(self, layer: int, fill, chunk: np.ndarray, half: int) -> None:
        """Copy the fill slots that lie in chunk (consecutive slots, in staging half `half`)
        into their cache rows."""
        matrix, slots, rows = fill                               # (cap, stride), (k,), (k,)
        sel = (slots >= chunk[0]) & (slots <= chunk[-1])         # (k,)
        if sel.any():
            matrix[rows[sel]] = self._half(layer, half)[slots[sel] - chunk[0]]

    def _half(self, layer: int, half: int) -> np.ndarray:
        """Staging half `half` (0 or 1) as rows of layer's stride: (rows, stride)."""
        s = self.f.strides[layer]
        flat = self.staging.reshape(-1)[half * self._half_bytes:(half + 1) * self._half_bytes]
        return flat[:len(flat) // s * s].reshape(-1, s)

    def _take_ahead(self, layer: int, first: np.ndarray):
        """(the pending read of layer's first chunk, its half) if one was issued ahead, else
        (None, 0); a read issued ahead for something else is waited for and dropped."""
        pending, self._ahead = self._ahead, None
        if pending is None:
            return None, 0
        p_layer, p_chunk, p_half, job = pending
        if p_layer == layer and np.array_equal(p_chunk, first):
            return job, p_half
        job.result()
        return None, 0

    def _read_chunk(self, layer: int, chunk: np.ndarray, half: int, t: TokenStats) -> None:
        """Slots chunk (k,) → staging half `half`: one run when they are consecutive."""
        out = self._half(layer, half)                                     # (step, stride)
        if int(chunk[-1] - chunk[0]) + 1 == len(chunk):
            self.reads.read_seq(layer, chunk, out, t)
        else:
            self.reads.read_rows(layer, chunk, out, np.arange(len(chunk), dtype=np.int32), t)

    def _compute_staged(self, layer: int, chunk: np.ndarray, half: int, h: np.ndarray,
                        x: np.ndarray) -> None:
        """x += FFN over staging half `half`, whose rows 0 .. k-1 hold slots chunk (k,)."""
        self._bundles(layer, self._half(layer, half)[:len(chunk)], chunk, h, x)

    # ---- predictor recall (check mode) -------------------------------------------------------

    def _check_recall(self, layer: int, h: np.ndarray, slots: np.ndarray, t: TokenStats) -> None:
        """Counts this token's exact active set (slow: dequantizes the layer) and how much of it
        the predictor found."""
        true = exact_active(self.flash, layer, h, self.threshold[layer])   # (a,) slots
        t.true_active += len(true)
        t.true_hits += int(np.isin(true, slots, assume_unique=True).sum())

