"""The per-layer neuron cache in DRAM (the paper's §3.3 structure, plus hot-neuron pins).

One preallocated, 4096-aligned matrix of `capacity` bundle rows of `stride` bytes, filled from
row 0 up to `count`. Rows 0 .. n_pinned-1 hold slots 0 .. n_pinned-1 (with hot-first order these
are the layer's hottest neurons, read in one sequential read at load) and are never evicted.
Every other row holds one slot; two int32 maps keep slot → row and row → slot exact, and a
last-use token index per row drives eviction:

    lookup(slots)  -> (rows of the hits, slots missing)     marks the hits used now
    insert(slots)  -> rows for a prefix of slots            the caller reads the bundles into them
    rows_of(slots) -> their rows (-1: not cached)           remove() moves rows: ask again after it
    split(k)                                                a full, all-pinned cache: see below

insert appends; when the matrix is full it first evicts rows not used in the last `window`
tokens (oldest first), then, while capacity still falls short, rows not used by the current
token (oldest first), and reads the new neurons straight into the evicted rows. remove() is the
paper's delete: the last live row is copied into the hole. Either way the live rows stay packed
in 0 .. count-1 and both maps stay exact. Rows of the current token are never evicted: when even
then the matrix cannot take every slot, insert returns rows for the first slots only and the
caller streams the rest (slots are sorted, so with hot-first order the hotter ones are cached).
Everything is vectorised numpy: no per-neuron Python on the hot path.

A cache whose rows never change (every row pinned and read: a static pass's) can be split(k):
the same memory then holds each row's first k bytes (gate | up) as `matrix` (capacity, k) and
the rest (the down column) as `down` (capacity, stride - k). The FFN kernel reads the rows as two
forward streams instead of one with a down column between every two rows (docs/KERNELS.md).
"""
from __future__ import annotations

import numpy as np

from flashllm.errors import FlashError
from flashllm.ffi.reader import aligned_empty

NEVER = np.iinfo(np.int64).min // 2     # last-use value of a row that was never used
CHUNK_ROWS = 64                         # rows split() moves at a time


class CacheError(FlashError):
    """A neuron cache asked for something it cannot hold (bad sizes or slots)."""


class NeuronCache:
    """The DRAM rows of one layer's FFN bundles: matrix, count, slot↔row maps, last use."""

    def __init__(self, n_slots: int, capacity: int, stride: int, window: int, n_pinned: int = 0):
        if not 0 <= n_pinned <= capacity <= n_slots or stride <= 0 or window < 1:
            raise CacheError(f"neuron cache of {capacity} rows ({n_pinned} pinned) cannot serve "
                             f"{n_slots} slots of {stride} bytes with a window of {window}")
        self.n_slots, self.capacity, self.stride, self.window = n_slots, capacity, stride, window
        self.n_pinned = n_pinned
        self._memory = aligned_empty(max(capacity, 1) * stride)               # (capacity * stride,)
        self.matrix = self._memory.reshape(-1, stride)                        # (capacity, stride)
        self.down: np.ndarray | None = None    # after split(): (capacity, stride - k) down columns
        self.row_of = np.full(n_slots, -1, dtype=np.int32)      # (n_slots,) row of a slot or -1
        self.slot_of = np.full(max(capacity, 1), -1, dtype=np.int32)  # (capacity,) slot of a row
        self.last_use = np.full(max(capacity, 1), NEVER, dtype=np.int64)  # (capacity,) token index
        self.count = 0
        self.now = 0                    # index of the current token
        self.copied_rows = 0            # rows moved by swap-delete since creation
        self.evicted_rows = 0

    @property
    def nbytes(self) -> int:
        """Resident bytes: the matrix and the maps."""
        return self._memory.nbytes + self.row_of.nbytes + self.slot_of.nbytes + self.last_use.nbytes

    def pin(self) -> np.ndarray:
        """Claim rows 0 .. n_pinned-1 for slots 0 .. n_pinned-1 (call once, on an empty cache);
        returns those slots (n_pinned,) int32 for the caller to read into rows of the same index."""
        if self.count:
            raise CacheError("pin() must come before any insert")
        slots = np.arange(self.n_pinned, dtype=np.int32)         # (n_pinned,)
        self.row_of[slots] = slots
        self.slot_of[:self.n_pinned] = slots
        self.count = self.n_pinned
        return slots

    def split(self, k: int) -> None:
        """Hold each row's first k bytes in `matrix` (capacity, k) and the rest in `down`
        (capacity, stride - k), in the same memory (a copy of the down columns is all it
        allocates, for the call). Only for a cache whose every row is pinned and filled."""
        cap = len(self.matrix)
        if self.down is not None or not 0 < k < self.stride or \
                not self.n_pinned == self.count == self.capacity == cap:
            raise CacheError(f"split({k}) needs a full cache of pinned rows of {self.stride} bytes")
        tails = self.matrix[:, k:].copy()                                 # (capacity, stride - k)
        heads = self._memory[:cap * k].reshape(cap, k)                   # (capacity, k)
        # row r's head moves to r * k <= r * stride: a chunk never writes over a later chunk's
        # rows (numpy buffers the overlap within one)
        for r in range(0, cap, CHUNK_ROWS):
            heads[r:r + CHUNK_ROWS] = self.matrix[r:r + CHUNK_ROWS, :k]
        self.matrix, self.down = heads, self._memory[cap * k:].reshape(tails.shape)
        self.down[:] = tails

    def next_token(self) -> None:
        """Start the next token: rows used from now on count as used by it."""
        self.now += 1

    def lookup(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows (h,) int32 of the cached slots, slots (m,) int32 not cached); hits marked used."""
        slots = np.asarray(slots, dtype=np.int32)                # (n,)
        rows = self.row_of[slots]                                # (n,) row or -1
        hit = rows >= 0                                          # (n,)
        rows_hit = rows[hit]                                     # (h,)
        self.last_use[rows_hit] = self.now
        return rows_hit, slots[~hit]

    def rows_of(self, slots: np.ndarray) -> np.ndarray:
        """Rows (n,) int32 of slots (n,), -1 where not cached. Rows returned by lookup stay valid
        only until the next insert, whose swap-deletes may move them."""
        return self.row_of[np.asarray(slots, dtype=np.int32)]

    def insert(self, slots: np.ndarray) -> np.ndarray:
        """Rows (k,) int32 for slots[:k] (k = len(slots) unless the current token fills the
        matrix), marked used now. The slots must not be cached already. Free rows are appended;
        when the matrix is full, evicted rows are reused in place (the copy a swap-delete would
        make is saved: the rows stay packed either way)."""
        slots = np.asarray(slots, dtype=np.int32)                # (n,)
        if len(slots) and (self.row_of[slots] >= 0).any():
            raise CacheError("insert() of a slot that is already cached")
        free = self.capacity - self.count
        victims = self._victims(len(slots) - free)               # (v,) rows to reuse
        n_new = min(len(slots) - len(victims), free)
        rows = np.concatenate([victims, np.arange(self.count, self.count + n_new,
                                                  dtype=np.int32)])  # (k,)
        self.row_of[self.slot_of[victims]] = -1
        self.row_of[slots[:len(rows)]] = rows
        self.slot_of[rows] = slots[:len(rows)]
        self.last_use[rows] = self.now
        self.count += n_new
        self.evicted_rows += len(victims)
        return rows

    def _victims(self, n: int) -> np.ndarray:
        """Up to n rows (int32) to evict: out-of-window rows first, then rows not used by this
        token; the oldest first in both cases (ties: the highest slot, with hot-first order the
        coldest); pinned rows and the current token's rows never."""
        if n <= 0:
            return np.zeros(0, dtype=np.int32)
        used = self.last_use[self.n_pinned:self.count]           # (count - pinned,)
        free_ok = np.flatnonzero(used < self.now)                # not this token's
        if len(free_ok) > n:
            slot = self.slot_of[self.n_pinned:self.count][free_ok].astype(np.int64)  # (f,)
            age_key = used[free_ok] * (self.n_slots + 1) + (self.n_slots - slot)     # (f,)
            free_ok = free_ok[np.argpartition(age_key, n - 1)[:n]]
        return (free_ok + self.n_pinned).astype(np.int32)

    def remove(self, rows: np.ndarray) -> None:
        """Swap-delete rows (k,) (distinct, unpinned, live): the last live rows move into the
        holes, so rows 0 .. count-1 stay packed and both maps stay exact."""
        rows = np.unique(np.asarray(rows, dtype=np.int32))       # (k,) sorted
        k = len(rows)
        if k == 0:
            return
        if rows[0] < self.n_pinned or rows[-1] >= self.count:
            raise CacheError(f"remove() of rows outside the unpinned live range "
                             f"[{self.n_pinned}, {self.count})")
        new_count = self.count - k
        self.row_of[self.slot_of[rows]] = -1
        holes = rows[rows < new_count]                           # (j,) holes to fill
        tail = np.arange(new_count, self.count, dtype=np.int32)  # (k,)
        movers = tail[~np.isin(tail, rows, assume_unique=True)]  # (j,) live rows past the end
        if len(holes):
            self.matrix[holes] = self.matrix[movers]
            self.slot_of[holes] = self.slot_of[movers]
            self.last_use[holes] = self.last_use[movers]
            self.row_of[self.slot_of[holes]] = holes
        self.slot_of[new_count:self.count] = -1
        self.last_use[new_count:self.count] = NEVER
        self.count = new_count
        self.copied_rows += len(holes)
        self.evicted_rows += k

    def window_rows(self) -> int:
        """Live rows used within the last `window` tokens (pins included)."""
        return int(np.count_nonzero(self.last_use[:self.count] > self.now - self.window)) + \
            int(np.count_nonzero(self.last_use[:self.n_pinned] <= self.now - self.window))
