"""A read-ahead ring: one thread reads a fixed schedule of bundle chunks, over and over, into a
ring of aligned buffers; the forward pass takes them in the same order.

When the bundles a token needs do not depend on the token (no predictor: every neuron outside
the pinned cache rows is read each token; or --naive), the reads of the whole token are known in
advance. The ring then keeps the device busy without waiting for compute: while layer l's FFN
computes over one buffer, the next buffers (the rest of layer l, layer l+1, ... and across the
token boundary, the next token's first layers) are already being read.

    ring = ReadRing(buffers, schedule, read)       buffers (n_buf, rows, stride) uint8
    rows, counters = ring.take(pos)                blocks until schedule[pos % len] is read
    ... compute over rows ...
    ring.release()                                 the buffer may be read into again
    ring.stop()                                    before anyone else uses the reader

`take(pos)` restarts the ring at pos when the caller is not where the ring expected (a prefill in
between, an interrupted forward pass), so a consumer can never get the wrong chunk. A read error
in the thread is raised by the take() that would have returned its chunk.
"""
from __future__ import annotations

import math
import threading
from collections import deque
from typing import Callable, Optional

import numpy as np

# read(layer, first_slot, n_slots, out (n, stride)) -> counters of that read (any object)
ReadFn = Callable[[int, int, int, np.ndarray], object]
PAGE = 4096


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


class ReadRing:
    """Read-ahead of schedule[i] = (layer, first slot, n slots) into buffers[i % n_buf]."""

    def __init__(self, buffers: np.ndarray, schedule: list, read: ReadFn):
        if buffers.ndim != 3 or len(buffers) < 2:
            raise ValueError("a read ring needs at least two (rows, stride) buffers")
        if not schedule or max(n for _, _, n in schedule) > buffers.shape[1]:
            raise ValueError("every scheduled chunk must fit one ring buffer")
        self.buffers, self.schedule, self.read = buffers, list(schedule), read  # (n_buf, rows, stride)
        self._thread: Optional[threading.Thread] = None
        self._expect = -1             # schedule position the next take() should ask for
        self._k = 0                   # ring index of the next take()

    def take(self, pos: int) -> tuple[np.ndarray, object]:
        """(rows (n, stride) holding schedule[pos % len], the read's counters); waits for it."""
        if self._thread is None or pos != self._expect:
            self.stop()
            self._start(pos)
        self._full.acquire()
        got, counters, error = self._done.popleft()
        if error is not None:
            self.stop()
            raise error
        assert got == pos, "read ring out of order"
        k, self._k, self._expect = self._k, (self._k + 1) % len(self.buffers), pos + 1
        return self.buffers[k, :self.schedule[pos % len(self.schedule)][2]], counters

    def release(self) -> None:
        """The buffer of the last take() may be read into again."""
        self._free.release()

    def stop(self) -> None:
        """Stop reading ahead (waits for the read in flight); what was read is dropped."""
        if self._thread is None:
            return
        self._halt.set()
        self._free.release()
        self._thread.join()
        self._thread, self._expect = None, -1

    @property
    def running(self) -> bool:
        return self._thread is not None

    def _start(self, pos: int) -> None:
        self._free = threading.Semaphore(len(self.buffers))
        self._full = threading.Semaphore(0)
        self._done: deque = deque()
        self._halt = threading.Event()
        self._k, self._expect = 0, pos
        self._thread = threading.Thread(target=self._run, args=(pos,), daemon=True,
                                        name="flashllm-ring")
        self._thread.start()

    def _run(self, pos: int) -> None:
        k, n = 0, len(self.schedule)
        while True:
            self._free.acquire()
            if self._halt.is_set():
                return
            layer, first, count = self.schedule[pos % n]
            try:
                counters, error = self.read(layer, first, count, self.buffers[k, :count]), None
            except Exception as e:          # noqa: BLE001 - handed to the consumer's take()
                counters, error = None, e
            self._done.append((pos, counters, error))
            self._full.release()
            if error is not None:
                return
            pos, k = pos + 1, (k + 1) % len(self.buffers)
