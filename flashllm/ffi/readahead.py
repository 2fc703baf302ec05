"""The read-ahead thread's binding (native/readahead.c, `fl_readahead`): one C thread reading a
fixed schedule of batches through readers, over and over, into a ring of buffers. What the
schedule holds and how a pass takes it is flashllm.storage.readahead's (the policy); this module
only packs it for C and calls it.

    ring = ReadAheadRing(readers, schedule, buffers)   schedule: ReadAheadSchedule, buffers (n_buf, bytes)
    k, delta, idle = ring.take(pos)                    buffer index, ReadStats of its read, seconds idle
    ring.release(); ring.stop(); ring.running; ring.close()
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashllm.ffi.lib import check, ffi, native
from flashllm.ffi.reader import Reader, ReadStats, int64_array, read_stats


@dataclass(frozen=True)
class ReadAheadSchedule:
    """fl_readahead_schedule's arrays: n entries, m requests in all."""

    reader_of: np.ndarray       # (n,) int32 index into the ring's readers of each entry
    first: np.ndarray           # (n + 1,) int64 entry e's requests are first[e] .. first[e+1]-1
    offsets: np.ndarray         # (m,) int64 file offsets
    lengths: np.ndarray         # (m,) int64 bytes
    dst: np.ndarray             # (m,) int64 byte offsets inside the entry's buffer
    max_gap: np.ndarray         # (n,) int64 Reader.read's merge limit per entry
    max_run: np.ndarray         # (n,) int64 Reader.read's read size limit per entry

    @classmethod
    def of(cls, reader_of, sizes, offsets, lengths, dst, max_gap, max_run) -> "ReadAheadSchedule":
        """From per-entry reader indexes (n,), request counts (n,) and the concatenated
        requests (m,), checked and made contiguous for C (KernelError naming a bad array)."""
        n = len(sizes)
        m = int(np.sum(sizes))
        return cls(np.ascontiguousarray(reader_of, np.int32),
                   int64_array(np.concatenate([[0], np.cumsum(sizes)]), "first", n + 1),
                   int64_array(offsets, "offsets", m), int64_array(lengths, "lengths", m),
                   int64_array(dst, "dst", m), int64_array(max_gap, "max_gap", n),
                   int64_array(max_run, "max_run", n))


class ReadAheadRing:
    """A running fl_readahead over readers (kept alive here) into buffers (n_buf, bytes) uint8."""

    def __init__(self, readers: list[Reader], schedule: ReadAheadSchedule, buffers: np.ndarray):
        lib = self._lib = native()
        self._readers, self._schedule = list(readers), schedule   # both must outlive the ring
        out = ffi.new("fl_readahead **")
        handles = ffi.new("fl_reader *[]", [r.handle for r in self._readers])
        s = schedule
        arrays = {"reader_of": ffi.from_buffer("int32_t[]", s.reader_of),
                  **{name: ffi.from_buffer("int64_t[]", getattr(s, attr)) for name, attr in (
                      ("first", "first"), ("offsets", "offsets"), ("lengths", "lengths"),
                      ("dst_offsets", "dst"), ("max_gap", "max_gap"), ("max_run", "max_run"))}}
        c_schedule = ffi.new("fl_readahead_schedule *", {"n_entries": len(s.max_gap), **arrays})
        status = lib.fl_readahead_open(handles, len(self._readers), c_schedule,
                                       ffi.from_buffer("uint8_t[]", buffers, require_writable=True),
                                       buffers.shape[1], buffers.shape[0], out)
        check(status, "opening the read-ahead")
        self._h = ffi.gc(out[0], lib.fl_readahead_close)
        self._k, self._delta = ffi.new("int32_t *"), ffi.new("fl_reader_stats_t *")
        self._idle = ffi.new("double *")

    def take(self, pos: int, what: str) -> tuple[int, ReadStats, float]:
        """(buffer index holding schedule position pos, its read's counters, seconds the thread
        waited for a free buffer before it); waits for the read. what: names the ring in an
        error."""
        status = self._lib.fl_readahead_take(self._h, pos, self._k, self._delta, self._idle)
        check(status, f"read-ahead of schedule position {pos} ({what})")
        return int(self._k[0]), read_stats(self._delta), float(self._idle[0])

    def skip(self, start: int, stop: int) -> None:
        """Schedule positions [start, stop) are handed over unread (fl_readahead_skip)."""
        check(self._lib.fl_readahead_skip(self._h, start, stop), "read-ahead skip")

    def release(self) -> None:
        check(self._lib.fl_readahead_release(self._h), "read-ahead release")

    def stop(self) -> None:
        if self._h is not None:
            check(self._lib.fl_readahead_stop(self._h), "read-ahead stop")

    @property
    def running(self) -> bool:
        if self._h is None:
            return False
        flag = ffi.new("int32_t *")
        return self._lib.fl_readahead_running(self._h, flag) == self._lib.FL_OK and bool(flag[0])

    def close(self) -> None:
        """Stop the thread and free it (idempotent)."""
        if self._h is not None:
            ffi.release(self._h)
            self._h = None
