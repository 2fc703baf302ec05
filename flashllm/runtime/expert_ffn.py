"""A mixture of experts streamed from flash under a DRAM budget: the router names the experts
before a byte is read, and only those experts' bundles are read.

Per layer and pass (runtime/moe.py has the math):

    experts, w = router(h)                         resident routers: exact, no predictor
    each routed expert: in the layer's ExpertCache (a hit), or one read of its contiguous
        bundles (n_ff·stride bytes, direct I/O) into a cache slot it claims, evicting the
        least used expert (frequency, then recency); with no slot to claim it streams through
        the staging buffer in chunks
    lookahead: the next layer's router applied to the current residual x (normed by the next
        layer's ffn_norm) guesses its experts; the ones not cached are read into its cache now,
        while this layer computes (stats: how often the guess named a routed expert)
    x += Σ w · expert(h): hits first, then each read as it lands (expert rows whose layout
        packs in place — q4_0, q5_0, q8_0, q6_k — are repacked in their cache slot the first
        time they are used again from it, so later uses take the packed matmul and experts read
        for one use are not packed: runtime/expert_math.py)

Reads go through one worker thread in order (one batch at a time per Reader); the C reader
splits each expert's read across its own threads. The shared expert (Qwen2-MoE) is read once at
load when the budget holds it, else streamed every pass.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import numpy as np

from flashllm.ffi import kernel
from flashllm.ffi.reader import Reader, aligned_empty
from flashllm.format.reader import FlashModel
from flashllm.runtime.budget import BudgetPlan
from flashllm.runtime.expert_math import ExpertMath, packs_in_place
from flashllm.runtime.interfaces import FfnStrategy
from flashllm.runtime.moe import Routers, add_shared, mix_experts, top_k
from flashllm.runtime.stats import FlashStats, TokenStats
from flashllm.storage.readahead import reader_delta
from flashllm.units import PAGE

clock = time.perf_counter
DECAY = 0.9                    # per-token decay of an expert's routing frequency (eviction score)


class ExpertCache:
    """One layer's cached experts: `capacity` page-aligned slots of one expert's bundles each."""

    def __init__(self, n_experts: int, capacity: int, expert_bytes: int):
        self.capacity, self.expert_bytes = capacity, expert_bytes
        slot = -(-expert_bytes // PAGE) * PAGE
        self.matrix = aligned_empty(max(capacity, 1) * slot).reshape(-1, slot)  # (capacity, slot)
        self.slot_of = np.full(n_experts, -1, dtype=np.int32)       # (n_experts,) slot or -1
        self.expert_of = np.full(max(capacity, 1), -1, dtype=np.int32)  # (capacity,) expert or -1
        self.freq = np.zeros(n_experts, dtype=np.float32)           # (n_experts,) decayed routings
        self.last = np.zeros(max(capacity, 1), dtype=np.int64)      # (capacity,) token of last use
        self.packed = np.zeros(max(capacity, 1), dtype=bool)        # (capacity,) repacked in place
        self.pending: dict[int, Future] = {}                         # expert -> its read in flight
        self.prefetched: set = set()                                 # read on a guess, not yet used
        self.now = 0

    @property
    def nbytes(self) -> int:
        return self.matrix.nbytes

    def rows(self, expert: int, stride: int) -> np.ndarray:
        """The cached bundles of expert (n_ff, stride) uint8."""
        return self.matrix[self.slot_of[expert], :self.expert_bytes].reshape(-1, stride)

    def routed(self, experts: np.ndarray) -> None:
        """A pass routed these experts (m,): their frequency and recency rise."""
        self.now += 1
        self.freq *= DECAY
        self.freq[experts] += 1.0
        cached = self.slot_of[experts]
        self.last[cached[cached >= 0]] = self.now

    def claim(self, expert: int, keep: np.ndarray) -> int:
        """A slot for expert (its bundles to be read into it): a free one, else the cached
        expert outside keep (m,) and not in flight that was routed least (then longest ago);
        -1 when none can go."""
        free = np.flatnonzero(self.expert_of[:self.capacity] < 0)
        if len(free):
            slot = int(free[0])
        else:
            held = self.expert_of[:self.capacity]                    # (capacity,)
            ok = ~np.isin(held, keep) & ~np.isin(held, list(self.pending))
            if not ok.any():
                return -1
            cand = np.flatnonzero(ok)
            slot = int(cand[np.lexsort((self.last[cand], self.freq[held[cand]]))[0]])
            self.slot_of[held[slot]] = -1
            self.prefetched.discard(int(held[slot]))
        self.expert_of[slot], self.slot_of[expert], self.last[slot] = expert, slot, self.now
        self.packed[slot] = False
        return slot


class ExpertFlashFfn(FfnStrategy):
    """An FFN strategy (runtime/ffn.py) for a mixture of experts whose bundles stay on flash."""

    def __init__(self, flash: FlashModel, plan: BudgetPlan, reader: Reader, n_threads: int = 1, naive: bool = False,
                 prefetch: bool = True, exact: bool = False):
        cfg, f = flash.config, flash.ffn
        self.f, self.reader, self.n_threads, self.exact = f, reader, n_threads, exact
        self.d, self.act, self.n_ff, self.n_layers = cfg.d_model, cfg.act, cfg.n_ff, cfg.n_layers
        self.n_experts, self.n_shared, self.eps = cfg.n_experts, cfg.n_ff_shared, cfg.norm_eps
        self.routers = Routers(flash, n_threads)
        self.math = ExpertMath(f, cfg.act, n_threads, exact)
        # per layer: experts read into the cache are repacked there for the matmul
        self.pack = [not exact and packs_in_place(f, i, cfg.n_ff) for i in range(cfg.n_layers)]
        self.next_norm = [flash.tensor(f"blk.{i}.ffn_norm.weight")           # (d_model,)
                          for i in range(1, cfg.n_layers)]
        rows = 0 if naive else plan.capacity
        shared_resident = bool(cfg.n_ff_shared) and rows >= cfg.n_ff_shared
        rows -= cfg.n_ff_shared if shared_resident else 0
        capacity = min(cfg.n_experts, rows // cfg.n_ff)
        self.prefetch = prefetch and not naive and capacity > cfg.n_experts_used
        self.caches = [ExpertCache(cfg.n_experts, capacity, cfg.n_ff * f.strides[i])
                       for i in range(cfg.n_layers)]
        # expert rows are computed whole: the staging buffer holds an expert at least
        staging = max(1, plan.staging_rows, *((cfg.n_ff, cfg.n_ff_shared) if f.expert_rows else ()))
        self.staging = aligned_empty(staging * f.stride).reshape(-1, f.stride)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="flashllm-experts")
        self.shared = [self._read_now(i, cfg.n_experts * cfg.n_ff, cfg.n_ff_shared)
                       if shared_resident else None for i in range(cfg.n_layers)]
        self._guess: list = [None] * cfg.n_layers       # per layer: the experts guessed for it
        self.rec = FlashStats("experts", {"summary": plan.summary() + f"; expert caches: "
                                          f"{capacity} of {cfg.n_experts} experts per layer"})
        self._token: Optional[TokenStats] = None

    # ---- the strategy seam -------------------------------------------------------------------

    def start_pass(self, n_tokens: int, prefill: bool, pos0: int = 0) -> None:
        self._token = self.rec.start("prefill" if prefill else "decode", n_tokens)

    def __call__(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        t, cache = self._token, self.caches[layer]
        t0 = clock()
        experts, weights = self.routers.route(layer, h)                  # (T, k), (T, k)
        needed = np.unique(experts)                                      # (m,)
        cache.routed(needed)
        self._score_guess(layer, needed, t)
        streamed = self._fetch(layer, needed, t)
        if self.prefetch and layer + 1 < self.n_layers and len(h) == 1:
            self._lookahead(layer + 1, x, t)
        t.predict_s += clock() - t0
        order = [e for e in needed if e not in cache.pending] + \
            [e for e in needed if e in cache.pending]                    # hits first
        mix_experts(h, x, experts, weights,
                    lambda e, hs, ys: self._run_expert(layer, e, hs, ys, streamed), order)
        gate = self.routers.shared_gate[layer]
        if gate is not None:
            add_shared(h, x, gate, lambda hs, ys: self._run_shared(layer, hs, ys))

    def stats(self) -> dict:
        return {**self.rec.to_dict(lambda size: 0.0), "read_threads": self.reader.n_threads}

    def forget_records(self) -> None:
        self.rec.tokens.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.reader.close()

    # ---- which experts are read ----------------------------------------------------------------

    def _fetch(self, layer: int, needed: np.ndarray, t: TokenStats) -> set:
        """Start reading the routed experts (m,) that are not cached into slots they claim;
        returns those that got no slot (to stream)."""
        cache, streamed = self.caches[layer], set()
        for e, job in list(cache.pending.items()):      # guesses read for nothing: settled
            if job.done() and e not in needed:
                cache.pending.pop(e).result()
        t.experts += len(needed)
        for e in needed:
            e = int(e)
            if cache.slot_of[e] >= 0:
                t.expert_hits += e not in cache.pending
                if e in cache.prefetched:
                    t.prefetch_used += 1
                    cache.prefetched.discard(e)
                continue
            if cache.claim(e, needed) < 0:
                streamed.add(e)
                continue
            t.expert_reads += 1
            cache.pending[e] = self._pool.submit(self._read_expert, layer, e, t)
        return streamed

    def _lookahead(self, nxt: int, x: np.ndarray, t: TokenStats) -> None:
        """Guess layer nxt's experts from the residual x (1, d): its router over x normed by
        its ffn_norm; read the guesses it does not hold."""
        h = kernel.rmsnorm(x, self.next_norm[nxt - 1], self.eps)        # (1, d_model)
        logits = kernel.matmul(self.routers.weights[nxt], h, None, self.n_threads, True)  # (1, E)
        guess = top_k(logits, self.routers.k, False)[0][0]               # (k,)
        self._guess[nxt] = guess
        cache = self.caches[nxt]
        for e in guess:
            e = int(e)
            if cache.slot_of[e] >= 0 or cache.claim(e, guess) < 0:
                continue
            t.prefetched += 1
            cache.prefetched.add(e)
            cache.pending[e] = self._pool.submit(self._read_expert, nxt, e, t)

    def _score_guess(self, layer: int, needed: np.ndarray, t: TokenStats) -> None:
        guess, self._guess[layer] = self._guess[layer], None
        if guess is not None:
            t.guessed += len(needed)
            t.guessed_right += int(np.isin(needed, guess).sum())

    # ---- reads and compute ---------------------------------------------------------------------

    def _read_expert(self, layer: int, e: int, t: TokenStats) -> None:
        """Expert e's bundles → its cache slot: one sequential read (the worker thread)."""
        cache = self.caches[layer]
        out = cache.matrix[cache.slot_of[e]]                             # (slot_bytes,)
        start = self.f.layer_offsets[layer] + e * cache.expert_bytes
        self._counted(t, np.array([start]), np.array([cache.expert_bytes]), out)

    def _counted(self, t: TokenStats, offsets: np.ndarray, lengths: np.ndarray,
                 out: np.ndarray) -> None:
        before = self.reader.stats()
        self.reader.read(offsets, lengths, out.reshape(-1), np.array([0]), max_gap=0, max_run=0)
        t.add_reads(reader_delta(before, self.reader.stats()))

    def _read_now(self, layer: int, first: int, n: int) -> np.ndarray:
        """Slots first .. first+n-1 of layer, read now into a new (n, its stride) array."""
        stride = self.f.strides[layer]
        out = aligned_empty(n * stride).reshape(n, stride)                # (n, stride)
        start = self.f.layer_offsets[layer] + first * stride
        self.reader.read(np.array([start]), np.array([n * stride]), out.reshape(-1),
                         np.array([0]), max_gap=0, max_run=0)
        return out

    def _run_expert(self, layer: int, e: int, hs: np.ndarray, ys: np.ndarray,
                    streamed: set) -> None:
        """ys (n, d) += expert e's FFN of hs (n, d): from its cache slot once its read landed,
        or streamed through the staging buffer."""
        t, cache = self._token, self.caches[layer]
        if e in streamed:
            self._stream(layer, e * self.n_ff, self.n_ff, hs, ys)
            return
        job = cache.pending.pop(e, None)
        if job is not None:
            t0 = clock()
            job.result()
            t.io_s += clock() - t0
        t0 = clock()
        rows, slot = cache.rows(e, self.f.strides[layer]), cache.slot_of[e]  # (n_ff, stride)
        if self.pack[layer] and job is None and not cache.packed[slot]:
            self.math.pack_slots(layer, rows)       # used again from the cache: worth packing
            cache.packed[slot] = True
        self.math.run(layer, self.math.packed_views(layer, rows) if cache.packed[slot] else rows,
                      hs, ys)
        t.compute_s += clock() - t0

    def _run_shared(self, layer: int, hs: np.ndarray, ys: np.ndarray) -> None:
        if self.shared[layer] is not None:
            self.math.run(layer, self.shared[layer], hs, ys)
        else:
            self._stream(layer, self.n_experts * self.n_ff, self.n_shared, hs, ys)

    def _stream(self, layer: int, first: int, n: int, hs: np.ndarray, ys: np.ndarray) -> None:
        """ys += the FFN over slots first .. first+n-1, read chunk by chunk into the staging
        buffer (no DRAM to keep them; expert rows: the whole expert at once)."""
        t, stride = self._token, self.f.strides[layer]
        step = n if self.f.expert_rows else len(self.staging) * self.f.stride // stride
        staging = self.staging.reshape(-1)[:step * stride].reshape(step, stride)  # (step, stride)
        for a in range(first, first + n, step):
            m = min(step, first + n - a)
            t0 = clock()
            start = np.array([self.f.layer_offsets[layer] + a * stride])
            self._pool.submit(self._counted, t, start, np.array([m * stride]),
                              staging[:m]).result()
            t1 = clock()
            self.math.run(layer, staging[:m], hs, ys)
            t.io_s += t1 - t0
            t.compute_s += clock() - t1
            t.streamed += m
