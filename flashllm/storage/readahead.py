"""The read-ahead: one C thread (native/readahead.c, `fl_readahead`, bound by ffi/readahead.py)
reads a fixed schedule of batches, over and over, into a ring of aligned buffers; the forward
pass takes them in the same order. (docs/ARCHITECTURE.md, "The read-ahead", tells why and when.)
This module is the policy: what the schedule holds, where a chunk is cut, what a take counts.

    ring = ReadAhead(buffers, entries)             buffers (n_buf, rows, stride) uint8
    rows, counters = ring.take(pos)                blocks until entries[pos % len] is read
    ... compute over rows ...
    ring.release()                                 the buffer may be read into again
    ring.close()                                   frees the C ring

`take(pos)` restarts the ring at pos when the caller is not where the ring expected (a prefill in
between, an interrupted forward pass), so a consumer can never get the wrong chunk. A read error
is raised by the take() of its position.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flashllm.errors import KernelError
from flashllm.ffi.readahead import ReadAheadRing, ReadAheadSchedule
from flashllm.ffi.reader import Reader
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


def page_step(step: int, stride: int) -> int:
    """Rows of stride bytes a ring buffer of step such rows holds, cut to whole pages when
    it holds one (buffers start on a page)."""
    page = page_rows(stride)
    return step // page * page if step >= page else step


def block_step(step: int, stride: int, block: int) -> int:
    """page_step's rows, cut further to whole blocks of `block` rows (the FFN kernel's sums,
    kernel.ffn_block) when they hold one unit of both: the chunks then start where those sums
    do (page_chunks from a first row on a block)."""
    page = page_rows(stride)
    unit = page * block // math.gcd(page, block)
    rows = page_step(step, stride)
    return rows // unit * unit if rows >= unit else rows


def as_rows(buf: np.ndarray, n: int, stride: int) -> np.ndarray:
    """The first n rows of stride bytes in ring rows buf (m, ring stride) uint8: (n, stride)."""
    return buf.reshape(-1)[:n * stride].reshape(n, stride)


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


class ReadAhead:
    """Read-ahead of entries[i % len] into buffers[(i - start) % n_buf], one C thread reading.
    The entries' readers must stay open and unused by anyone else while it runs."""

    def __init__(self, buffers: np.ndarray, entries: list):
        if buffers.ndim != 3 or len(buffers) < 2 or buffers.dtype != np.uint8 \
                or not buffers.flags.c_contiguous:
            raise KernelError("read-ahead needs at least two C-contiguous (rows, stride) uint8 buffers")
        if not entries or max(e.rows for e in entries) > buffers.shape[1] or \
                max(int(np.max(np.asarray(e.dst) + e.lengths, initial=0)) for e in entries) > \
                buffers[0].nbytes:
            raise KernelError("every scheduled chunk must fit one read-ahead buffer")
        self.buffers, self.schedule = buffers, list(entries)      # (n_buf, rows, stride)
        readers = list({id(e.reader): e.reader for e in entries}.values())
        self._what = f"{readers[0].path.name} ..."
        flat = buffers.reshape(len(buffers), -1)                  # (n_buf, bytes)
        self._ring = ReadAheadRing(readers, self._pack(entries, readers), flat)

    @staticmethod
    def _pack(entries: list, readers: list) -> ReadAheadSchedule:
        """The schedule as C arrays: each entry's reader, then its requests concatenated."""
        index = {id(r): i for i, r in enumerate(readers)}
        cat = lambda name: np.concatenate([np.asarray(getattr(e, name), np.int64).reshape(-1)
                                           for e in entries])     # (m,)
        return ReadAheadSchedule.of([index[id(e.reader)] for e in entries],
                                    [len(e.offsets) for e in entries], cat("offsets"),
                                    cat("lengths"), cat("dst"), [e.max_gap for e in entries],
                                    [e.max_run for e in entries])

    def take(self, pos: int) -> tuple[np.ndarray, dict]:
        """(rows (n, stride) holding entries[pos % len], the read's counters and ring_idle_s:
        how long the reader had waited for a free buffer before it); waits for it."""
        k, delta, idle = self._ring.take(pos, self._what)
        rows = self.buffers[k, :self.schedule[pos % len(self.schedule)].rows]   # (n, stride)
        return rows, {**read_counters(delta), "ring_idle_s": idle}

    def skip(self, start: int, stop: int) -> None:
        """Positions [start, stop) are handed over unread: their take() gives stale bytes and
        zero counters (a consumer that needs none of them, as a grammar's head)."""
        self._ring.skip(start, stop)

    def release(self) -> None:
        """The buffer of the last take() may be read into again."""
        self._ring.release()

    def stop(self) -> None:
        """Stop reading ahead (waits for the read in flight); what was read is dropped."""
        self._ring.stop()

    @property
    def running(self) -> bool:
        return self._ring.running

    def close(self) -> None:
        """Stop the thread and free it (idempotent); the read-ahead cannot be used after."""
        self._ring.close()
