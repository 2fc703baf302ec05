"""cffi build script: compiles native/*.c into the extension module flashllm.ffi._native.

The cdef is the CDEF-BEGIN .. CDEF-END section of native/flashllm.h, so the header is the single
source of truth for the C API.
"""
from pathlib import Path

import cffi

NATIVE = Path(__file__).resolve().parent
HEADER = NATIVE / "flashllm.h"
SOURCES = sorted(str(p.relative_to(NATIVE.parent)) for p in NATIVE.glob("*.c"))
# -Wmissing-prototypes: a function with external linkage has its prototype in a header (its
# module's X.h, or flashllm.h), so what a module offers is what its header says
CFLAGS = ["-O3", "-march=native", "-std=c11", "-Wall", "-Wextra", "-Wmissing-prototypes",
          "-D_GNU_SOURCE"]


def cdef_text(header: str) -> str:
    """The part of the header between the CDEF markers."""
    start = header.index("/* CDEF-BEGIN */") + len("/* CDEF-BEGIN */")
    return header[start:header.index("/* CDEF-END */")]


ffibuilder = cffi.FFI()
ffibuilder.cdef(cdef_text(HEADER.read_text()))
ffibuilder.set_source(
    "flashllm.ffi._native",
    # cffi's generated module defines PyInit__native without a prototype of ours
    '#include "flashllm.h"\n#pragma GCC diagnostic ignored "-Wmissing-prototypes"',
    sources=SOURCES,
    include_dirs=[str(NATIVE.relative_to(NATIVE.parent))],
    extra_compile_args=CFLAGS,
    extra_link_args=["-lpthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
