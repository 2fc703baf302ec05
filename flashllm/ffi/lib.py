"""The C library, loaded once: the only import of the compiled cffi module (flashllm.ffi._native),
the CPU check every other binding relies on, and the one table of C status codes.

The library is compiled with -march=native: on a CPU without the SIMD extensions it was built
for, its first vector instruction would kill the process (SIGILL). So `fl_cpu_check` runs on
import, before anything else is called, and `native()` refuses with a clear KernelError instead.
"""
from __future__ import annotations

from flashllm.errors import KernelError

try:
    from flashllm.ffi._native import ffi, lib
except ImportError as exc:  # the extension was not built
    ffi = lib = None
    _PROBLEM = f"is not built ({exc})"
else:
    _PROBLEM = ""
    _missing = ffi.new("char[]", 32)
    if lib.fl_cpu_check(_missing, 32) != 0:
        _PROBLEM = (f"was compiled for a CPU with {ffi.string(_missing).decode()}, which this one "
                    "lacks")
        lib = None

STATUS = {                       # FL_* status codes of native/flashllm.h
    1: "invalid argument",
    2: "out of memory",
    3: "read error from the device",
    4: "request outside the file",
    5: "not supported by this build",
}


def native():
    """The cffi lib, or a KernelError telling the user how to build it."""
    if lib is None:
        raise KernelError(f"the C kernel flashllm.ffi._native {_PROBLEM}: run `make setup` (or "
                          "`make native` to rebuild it in place)")
    return lib


def check(status: int, what: str) -> None:
    """KernelError naming `what` and the status unless status is FL_OK (0)."""
    if status != 0:
        raise KernelError(f"{what} failed: {STATUS.get(status, f'status {status}')}")
