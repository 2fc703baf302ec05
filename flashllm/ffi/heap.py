"""The process heap: give freed pages back to the OS (libc, through ctypes: not the kernel); and
memory that may be backed by huge pages (huge_empty).

glibc serves large allocations from mmap until one is freed, then raises its threshold and serves
the next ones from the heap, which keeps freed pages: loading a model (a tensor read, packed into
a new layout, the read copy freed) would leave tens of MiB resident that no --dram-budget plan
counts (the 1.5B's packed attention: 80 MiB). trim_heap() returns them.
"""
from __future__ import annotations

import ctypes
import mmap

import numpy as np


def trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc malloc_trim); a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


HUGE = 2 << 20      # bytes of a transparent huge page (x86-64, arm64 with 4 KiB pages)


def huge_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array (nbytes) starting on a 2 MiB boundary, in anonymous memory
    the kernel may back with 2 MiB pages (madvise MADV_HUGEPAGE: transparent huge pages are
    often 'madvise' only). Weights streamed from DRAM at every token read faster from them: one
    TLB entry a 2 MiB page, no page walk every 4 KiB (a mixture of experts' decode, 8 experts of
    3.5 MiB a layer: 19.1 -> 16.3 ms a token at best, docs/KERNELS.md). Freed with the array."""
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(m, dtype=np.uint8)                               # (nbytes + HUGE,)
    start = (-raw.ctypes.data) % HUGE
    if hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
        except OSError:                     # a kernel without transparent huge pages
            pass
    return raw[start:start + nbytes]
