"""The process heap: give freed pages back to the OS (libc, through ctypes: not the kernel).

glibc serves large allocations from mmap until one is freed, then raises its threshold and serves
the next ones from the heap, which keeps freed pages: loading a model (a tensor read, packed into
a new layout, the read copy freed) would leave tens of MiB resident that no --dram-budget plan
counts (the 1.5B's packed attention: 80 MiB). trim_heap() returns them.
"""
from __future__ import annotations

import ctypes


def trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc malloc_trim); a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
