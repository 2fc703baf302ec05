"""The neuron cache under random token sequences, checked against a plain-Python reference:
slot↔row maps exact after swap-delete, window eviction, capacity never exceeded, pins kept."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from flashllm.runtime.neuron_cache import CacheError, NeuronCache

STRIDE = 64


def signature(slots: np.ndarray) -> np.ndarray:
    """(k, STRIDE) uint8 content that identifies each slot: what a read would put in its row."""
    s = np.asarray(slots, dtype=np.int64)[:, None]                     # (k, 1)
    return ((s * 7 + np.arange(STRIDE)) % 251).astype(np.uint8)        # (k, STRIDE)


def step(cache: NeuronCache, active: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One token through the cache, reads simulated by writing each slot's signature; returns
    the slots of the hits (as lookup reported them), the misses and the new rows."""
    cache.next_token()
    rows_hit, miss = cache.lookup(active)
    hit_slots = cache.slot_of[rows_hit]
    rows = cache.insert(miss)
    assert (cache.rows_of(hit_slots) >= 0).all()        # the current token's hits stay cached
    cache.matrix[rows] = signature(miss[:len(rows)])
    return hit_slots, miss, rows


def check_exact(cache: NeuronCache) -> None:
    """Every invariant of the structure, from its arrays alone."""
    n = cache.count
    assert 0 <= n <= cache.capacity
    live = cache.slot_of[:n]                                            # (count,)
    assert (live >= 0).all() and len(set(live.tolist())) == n
    assert (cache.row_of[live] == np.arange(n)).all()
    assert (cache.slot_of[n:cache.capacity] == -1).all()
    assert np.count_nonzero(cache.row_of >= 0) == n
    assert (cache.slot_of[:cache.n_pinned] == np.arange(cache.n_pinned)).all()
    assert np.array_equal(cache.matrix[:n], signature(live))


def run_reference(n_slots, capacity, pinned, window, tokens):
    """Drive a cache and a dict-based LRU model side by side; compare after every token."""
    cache = NeuronCache(n_slots, capacity, STRIDE, window, pinned)
    cache.matrix[cache.pin()] = signature(np.arange(pinned))
    last: dict[int, int] = {}               # reference: resident unpinned slot -> last token used
    history: list[set] = []
    for now, active in enumerate(tokens, start=1):
        active = np.unique(np.asarray(active, dtype=np.int32))          # (a,) sorted
        hits, miss, rows = step(cache, active)
        resident = set(range(pinned)) | set(last)
        assert set(hits.tolist()) == set(active.tolist()) & resident
        assert set(miss.tolist()) == set(active.tolist()) - resident
        for s in active.tolist():
            if s in last:
                last[s] = now
        free = capacity - pinned - len(last)
        short = len(miss) - free
        if short > 0:       # evict the oldest rows not used by this token, ties: highest slot
            old = sorted((t, -s) for s, t in last.items() if t < now)
            for _, neg_slot in old[:short]:
                del last[-neg_slot]
        fit = min(len(miss), capacity - pinned - len(last))
        assert len(rows) == fit
        for s in miss[:fit].tolist():
            last[s] = now
        check_exact(cache)
        assert set(cache.slot_of[:cache.count].tolist()) == set(range(pinned)) | set(last)
        history.append(set(active.tolist()))
        union = set().union(*history[-window:]) | set(range(pinned))
        if len(union) <= capacity:
            assert union <= set(cache.slot_of[:cache.count].tolist())


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_token_sequences_match_reference(data):
    n_slots = data.draw(st.integers(1, 60))
    capacity = data.draw(st.integers(0, n_slots))
    pinned = data.draw(st.integers(0, capacity))
    window = data.draw(st.integers(1, 5))
    tokens = data.draw(st.lists(st.lists(st.integers(0, n_slots - 1), max_size=n_slots),
                                min_size=1, max_size=25))
    run_reference(n_slots, capacity, pinned, window, tokens)


def test_long_seeded_run_with_skewed_activity():
    rng = np.random.default_rng(7)
    n_slots, p = 300, 1.0 / np.arange(1, 301) ** 0.8
    tokens = [rng.choice(n_slots, size=rng.integers(20, 120), replace=False, p=p / p.sum())
              for _ in range(200)]
    run_reference(n_slots, 150, 30, 3, tokens)


def test_swap_delete_moves_last_rows_into_holes():
    cache = NeuronCache(10, 6, STRIDE, 1, 1)
    cache.matrix[cache.pin()] = signature(np.arange(1))
    step(cache, np.array([3, 5, 7, 8, 9]))   # rows 1..5 hold slots 3 5 7 8 9
    cache.remove(np.array([1, 4]))            # drop slots 3 and 8: slot 9 (row 5) moves to row 1
    assert cache.slot_of[:cache.count].tolist() == [0, 9, 5, 7]
    assert cache.row_of[[3, 8, 9]].tolist() == [-1, -1, 1]
    assert cache.copied_rows == 1
    check_exact(cache)


def test_pinned_rows_cannot_be_removed_and_bad_sizes_are_refused():
    cache = NeuronCache(10, 4, STRIDE, 2, 2)
    cache.pin()
    with pytest.raises(CacheError, match="outside the unpinned live range"):
        cache.remove(np.array([0]))
    with pytest.raises(CacheError, match="cannot serve"):
        NeuronCache(10, 11, STRIDE, 2)
    step(cache, np.array([4]))
    with pytest.raises(CacheError, match="already cached"):
        cache.insert(np.array([4], dtype=np.int32))


def test_matrix_is_aligned_for_direct_io():
    cache = NeuronCache(100, 33, 96, 2)
    assert cache.matrix.ctypes.data % 4096 == 0 and cache.matrix.shape == (33, 96)


def test_split_keeps_each_rows_head_and_tail_apart_in_the_same_memory():
    rng = np.random.default_rng(0)
    cache = NeuronCache(300, 200, 96, 2, 200)                             # rows moved in chunks
    rows = rng.integers(0, 256, (200, 96), dtype=np.uint8)               # (200, 96)
    cache.matrix[cache.pin()] = rows
    before = cache.nbytes
    cache.split(40)
    assert cache.matrix.shape == (200, 40) and cache.down.shape == (200, 56)
    np.testing.assert_array_equal(cache.matrix, rows[:, :40])
    np.testing.assert_array_equal(cache.down, rows[:, 40:])
    assert cache.nbytes == before and cache.matrix.flags.c_contiguous and cache.down.flags.c_contiguous
    assert np.shares_memory(cache.matrix, cache._memory) and np.shares_memory(cache.down, cache._memory)
    with pytest.raises(CacheError, match="split"):
        cache.split(40)                                                   # once only
    part = NeuronCache(10, 6, 96, 2, 3)                                   # rows left to insert
    part.pin()
    with pytest.raises(CacheError, match="split"):
        part.split(40)
