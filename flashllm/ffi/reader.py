"""The direct-I/O reader: the only module that calls the I/O half of the cffi module.

A `Reader` owns one open file (O_DIRECT where the filesystem allows it) and, in C, either an
io_uring that keeps `n_threads` reads in flight from the calling thread (the default where the
kernel offers it) or a pool of `n_threads` reader threads. `Reader.read` takes a batch of (offset, length) requests and puts request i's
bytes at `dst[dst_offsets[i]:]`; neighbouring requests are merged into page-aligned reads, and
holes of at most `max_gap` bytes are read through when one larger read is cheaper (the cost
model in costmodel.py picks `max_gap`). `Reader.read_bundles` is the neuron cache's verb: fixed
stride bundles of one layer into rows of a preallocated matrix. The read-ahead over readers
(native/readahead.c) is bound in readahead.py.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Tuple

import numpy as np

from flashllm.ffi.lib import check, ffi, native
from flashllm.errors import KernelError
from flashllm.units import PAGE

DEFAULT_STAGE = 1 << 20       # per-thread staging buffer = the largest single read


class DirectIOWarning(UserWarning):
    """The filesystem refused O_DIRECT: reads go through the page cache."""


@dataclass(frozen=True)
class ReadStats:
    """Counters of a reader since open or reset (see fl_reader_stats_t)."""

    batches: int
    requests: int
    reads: int
    bytes_requested: int
    bytes_read: int
    gap_bytes: int
    merged_requests: int
    seconds: float

    @property
    def gib_per_s(self) -> float:
        """Device bytes per second of wall time spent in reads."""
        return self.bytes_read / self.seconds / 2**30 if self.seconds > 0 else 0.0

    @property
    def avg_read(self) -> float:
        return self.bytes_read / self.reads if self.reads else 0.0


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array (nbytes) whose data starts on a 4096-byte boundary."""
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)  # (nbytes + PAGE)
    start = (-raw.ctypes.data) % PAGE
    return raw[start:start + nbytes]


def int64_array(values: np.ndarray, name: str, n: int) -> np.ndarray:
    """values as a contiguous (n,) int64 array for C; KernelError naming `name` otherwise."""
    arr = np.ascontiguousarray(values, dtype=np.int64)  # (n,)
    if arr.shape != (n,):
        raise KernelError(f"{name} has shape {arr.shape}, expected ({n},)")
    return arr


def plan_reads(offsets: np.ndarray, lengths: np.ndarray, max_gap: int,
               max_run: int = DEFAULT_STAGE) -> Tuple[int, int, int]:
    """(reads, bytes read, gap bytes) that a Reader would issue for these requests."""
    lib = native()
    n = len(offsets)
    offs, lens = int64_array(offsets, "offsets", n), int64_array(lengths, "lengths", n)  # (n,) (n,)
    out = ffi.new("int64_t[3]")
    status = lib.fl_io_plan(ffi.from_buffer("int64_t[]", offs), ffi.from_buffer("int64_t[]", lens),
                            n, max_gap, max_run, out, out + 1, out + 2)
    check(status, "planning reads")
    return int(out[0]), int(out[1]), int(out[2])


class Reader:
    """Batched parallel reads of one file; use as a context manager or call close()."""

    def __init__(self, path: Path, n_threads: int = 8, direct: bool = True,
                 stage_bytes: int = DEFAULT_STAGE, ring: bool = True) -> None:
        """n_threads: reads in flight (io_uring) or pool threads; ring=False forces the pool."""
        lib = self._lib = native()
        self.path = Path(path)
        out = ffi.new("fl_reader **")
        flags = (lib.FL_READ_DIRECT if direct else 0) | (lib.FL_READ_RING if ring else 0)
        status = lib.fl_reader_open(str(self.path).encode(), n_threads, flags, stage_bytes, out)
        if status == lib.FL_EIO:
            raise KernelError(f"cannot open {self.path} for reading")
        check(status, f"opening a reader on {self.path} with {n_threads} threads")
        self._h = ffi.gc(out[0], lib.fl_reader_close)
        info_flags, info_size, info_threads = ffi.new("int32_t *"), ffi.new("int64_t *"), ffi.new("int32_t *")
        check(lib.fl_reader_info(self._h, info_flags, info_size, info_threads), "reader info")
        self.direct = bool(info_flags[0] & lib.FL_READ_DIRECT)
        self.ring = bool(info_flags[0] & lib.FL_READ_RING)  # io_uring in use (else the pool)
        self.file_size = int(info_size[0])
        self.n_threads = int(info_threads[0])
        if direct and not self.direct:
            warnings.warn(f"{self.path}: the filesystem refuses O_DIRECT; reading through the "
                          "page cache (throughput figures will not be the device's)", DirectIOWarning,
                          stacklevel=2)

    def read(self, offsets: np.ndarray, lengths: np.ndarray, dst: np.ndarray,
             dst_offsets: np.ndarray, max_gap: int = 0, max_run: int = 0) -> None:
        """File bytes [offsets[i], offsets[i] + lengths[i]) → dst[dst_offsets[i]:] for each i.

        dst: a writable C-contiguous uint8 array (4096-aligned for in-place reads, see
        aligned_empty). max_gap < 0 disables merging; max_run <= 0 means the staging size.
        """
        lib = self._lib
        n = len(offsets)
        offs, lens = int64_array(offsets, "offsets", n), int64_array(lengths, "lengths", n)  # (n,) (n,)
        douts = int64_array(dst_offsets, "dst_offsets", n)  # (n,)
        if dst.dtype != np.uint8 or not dst.flags.c_contiguous or not dst.flags.writeable:
            raise KernelError("read destination must be a writable C-contiguous uint8 array")
        if n and (douts.min() < 0 or int((douts + lens).max()) > dst.nbytes):
            raise KernelError(f"read destination of {dst.nbytes} bytes is too small for the batch")
        status = lib.fl_reader_read(self._h, ffi.from_buffer("int64_t[]", offs),
                                    ffi.from_buffer("int64_t[]", lens),
                                    ffi.from_buffer("uint8_t[]", dst, require_writable=True),
                                    ffi.from_buffer("int64_t[]", douts), n, max_gap, max_run)
        if status == lib.FL_ERANGE:
            bad = int(np.flatnonzero((offs < 0) | (lens < 0) | (offs + lens > self.file_size))[0])
            raise KernelError(f"{self.path}: request {bad} (offset {offs[bad]}, {lens[bad]} bytes) "
                              f"is outside the file ({self.file_size} bytes)")
        check(status, f"reading {n} requests from {self.path}")

    def read_bundles(self, base: int, stride: int, ids: np.ndarray, out: np.ndarray,
                     slots: np.ndarray, max_gap: int = 0, max_run: int = 0) -> None:
        """Bundles ids[i] (stride bytes at base + ids[i] * stride) → rows slots[i] of out.

        out: (capacity, stride) uint8 matrix; ids, slots: (n,) integers.
        """
        if out.ndim != 2 or out.shape[1] != stride or not out.flags.c_contiguous:
            raise KernelError(f"bundle matrix must be a C-contiguous (capacity, {stride}) array, "
                              f"got shape {out.shape}")
        ids64 = np.asarray(ids, dtype=np.int64)  # (n,)
        offsets = base + ids64 * stride  # (n,)
        lengths = np.full(len(ids64), stride, dtype=np.int64)  # (n,)
        self.read(offsets, lengths, out.reshape(-1), np.asarray(slots, dtype=np.int64) * stride,
                  max_gap=max_gap, max_run=max_run)

    @property
    def handle(self):
        """The C fl_reader * (the read-ahead reads through it)."""
        return self._h

    def stats(self) -> ReadStats:
        lib = self._lib
        s = ffi.new("fl_reader_stats_t *")
        check(lib.fl_reader_stats(self._h, s), "reader stats")
        return read_stats(s)

    def reset_stats(self) -> None:
        lib = self._lib
        check(lib.fl_reader_reset_stats(self._h), "reader stats reset")

    def close(self) -> None:
        """Join the threads and close the file (idempotent)."""
        if self._h is not None:
            ffi.release(self._h)
            self._h = None

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_stats(s) -> ReadStats:
    """A C fl_reader_stats_t as ReadStats."""
    return ReadStats(s.batches, s.requests, s.reads, s.bytes_requested, s.bytes_read, s.gap_bytes,
                     s.merged_requests, s.seconds)
