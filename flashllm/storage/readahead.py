"""A read-ahead ring: one C thread (native/readahead.c) reads a fixed schedule of batches, over
and over, into a ring of aligned buffers; the forward pass takes them in the same order.

When the bundles a token needs do not depend on the token (no predictor: every neuron outside
the pinned cache rows is read each token; or --naive), the reads of the whole token are known in
advance. The ring then keeps the device busy without waiting for compute: while layer l's FFN
computes over one buffer, the next buffers (the rest of layer l, layer l+1, ... and across the
token boundary, the next token's first layers) are already being read. The reading thread is
C: no interpreter lock or Python frame sits between two reads.

    ring = ReadRing(buffers, entries)              buffers (n_buf, rows, stride) uint8
    rows, counters = ring.take(pos)                blocks until entries[pos % len] is read
    ... compute over rows ...
    ring.release()                                 the buffer may be read into again
    ring.stop()                                    before anyone else uses the readers
    ring.close()                                   frees the C ring

`take(pos)` restarts the ring at pos when the caller is not where the ring expected (a prefill in
between, an interrupted forward pass), so a consumer can never get the wrong chunk. A read error
is raised by the take() of its position.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flashllm.ffi.reader import ReadAhead, Reader
from flashllm.units import PAGE


def page_rows(stride: int) -> int:
    """The fewest rows of stride bytes that make whole pages."""
    return PAGE // math.gcd(stride, PAGE)


def page_chunks(base: int, stride: int, first: int, k: int, step: int) -> list[tuple[int, int]]:
    """Row ranges [a, b) covering first .. k-1 of rows stride bytes long from file offset base,
    at most step long, cut where a row starts on a page when the stride allows: a read that starts
    on a page lands in its (page-aligned) buffer directly, with no copy through staging."""
    page = page_rows(stride)
    aligned = [s for s in range(first, min(k, first + page)) if (base + s * stride) % PAGE == 0]
    if not aligned or step < page:
        return [(a, min(a + step, k)) for a in range(first, k, step)]
    cuts = sorted({first, *range(aligned[0], k, step // page * page)}) + [k]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def reader_delta(before, after) -> dict:
    """Counters (TokenStats fields) of the reads between two Reader.stats() snapshots."""
    b = read_counters(before)
    return {k: v - b[k] for k, v in read_counters(after).items()}


def read_counters(delta) -> dict:
    """Counters (TokenStats fields) of one read's ReadStats delta (the read-ahead ring's take)."""
    return {"bytes_read": delta.bytes_read, "bytes_requested": delta.bytes_requested,
            "gap_bytes": delta.gap_bytes, "reads": delta.reads, "read_s": delta.seconds}


@dataclass(frozen=True)
class Entry:
    """One schedule entry: requests through one reader into one ring buffer."""

    key: object                 # what the consumer calls it
    rows: int                   # buffer rows it fills: take() returns rows 0 .. rows-1
    reader: Reader
    offsets: np.ndarray         # (m,) file offsets
    lengths: np.ndarray         # (m,) bytes
    dst: np.ndarray             # (m,) byte offsets inside the buffer
    max_gap: int = 0            # Reader.read's merge and run limits
    max_run: int = 0


class ReadRing:
    """Read-ahead of entries[i % len] into buffers[(i - start) % n_buf]."""

    def __init__(self, buffers: np.ndarray, entries: list):
        if buffers.ndim != 3 or len(buffers) < 2:
            raise ValueError("a read ring needs at least two (rows, stride) buffers")
        if not entries or max(e.rows for e in entries) > buffers.shape[1] or \
                max(int(np.max(np.asarray(e.dst) + e.lengths, initial=0)) for e in entries) > \
                buffers[0].nbytes:
            raise ValueError("every scheduled chunk must fit one ring buffer")
        self.buffers, self.schedule = buffers, list(entries)      # (n_buf, rows, stride)
        readers = list({id(e.reader): e.reader for e in entries}.values())
        index = {id(r): i for i, r in enumerate(readers)}
        sizes = [len(e.offsets) for e in entries]
        cat = lambda name: np.concatenate([np.asarray(getattr(e, name), np.int64).reshape(-1)
                                           for e in entries])     # (m,)
        self._c = ReadAhead(readers, np.array([index[id(e.reader)] for e in entries]),
                            np.concatenate([[0], np.cumsum(sizes)]), cat("offsets"),
                            cat("lengths"), cat("dst"), np.array([e.max_gap for e in entries]),
                            np.array([e.max_run for e in entries]),
                            buffers.reshape(len(buffers), -1))

    def take(self, pos: int) -> tuple[np.ndarray, dict]:
        """(rows (n, stride) holding entries[pos % len], the read's counters and ring_idle_s:
        how long the reader had waited for a free buffer before it); waits for it."""
        k, delta, idle = self._c.take(pos)
        rows = self.buffers[k, :self.schedule[pos % len(self.schedule)].rows]   # (n, stride)
        return rows, {**read_counters(delta), "ring_idle_s": idle}

    def release(self) -> None:
        """The buffer of the last take() may be read into again."""
        self._c.release()

    def stop(self) -> None:
        """Stop reading ahead (waits for the read in flight); what was read is dropped."""
        self._c.stop()

    def close(self) -> None:
        """Stop and free the C ring; the ring cannot be used after."""
        self._c.close()

    @property
    def running(self) -> bool:
        return self._c.running
