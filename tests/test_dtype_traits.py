"""flashllm/model/tensor.py's dtype tables agree with the C kernel's (native/dtype.h, the block
layouts; native/traits.c, the kernels): the codes are flashllm.h's FL_* enum, each block size and
block bytes is what fl_row_bytes computes, C knows no dtype Python does not, and C quantizes every
dtype Python makes from floats. Python keeps its own copy because model/ sits below ffi/ (the
format code reads tensors without the extension); this test is what keeps the copies one."""
import numpy as np
import pytest

from flashllm.ffi.lib import ffi, native
from flashllm.model.tensor import (BLOCK_BYTES, BLOCK_SIZE, DTYPE_CODES, DTYPES, KQUANTS,
                                   QUANTIZABLE)

LIB = native()


@pytest.mark.parametrize("name", DTYPES)
def test_code_is_the_c_enum(name):
    assert DTYPE_CODES[name] == getattr(LIB, "FL_" + name.upper())


@pytest.mark.parametrize("name", DTYPES)
def test_block_layout_is_c_row_bytes(name):
    code, block = DTYPE_CODES[name], BLOCK_SIZE[name]
    assert [LIB.fl_row_bytes(code, n) for n in range(1, block)] == [0] * (block - 1)
    assert LIB.fl_row_bytes(code, block) == BLOCK_BYTES[name]
    assert LIB.fl_row_bytes(code, 7 * block) == 7 * BLOCK_BYTES[name]


def test_c_knows_no_other_dtype():
    assert list(DTYPE_CODES.values()) == list(range(len(DTYPES)))
    for code in (-1, len(DTYPES), len(DTYPES) + 1):
        assert LIB.fl_row_bytes(code, 256) == 0


@pytest.mark.parametrize("name", QUANTIZABLE + KQUANTS + ("q2_k",))
def test_c_quantizes(name):
    code, n = DTYPE_CODES[name], 256
    x = np.linspace(-1.0, 1.0, n, dtype=np.float32)  # (n,)
    out = np.zeros(LIB.fl_row_bytes(code, n), np.uint8)
    st = LIB.fl_quantize_row(code, ffi.cast("const float *", x.ctypes.data),
                             ffi.cast("void *", out.ctypes.data), n)
    assert st == LIB.FL_OK
    back = np.zeros(n, np.float32)  # (n,)
    assert LIB.fl_dequantize_row(code, ffi.cast("const void *", out.ctypes.data),
                                 ffi.cast("float *", back.ctypes.data), n) == LIB.FL_OK
    assert np.abs(back - x).max() < 0.2


def test_q3_k_has_no_quantizer():
    """q3_k rows are only copied from GGUF files: C says so instead of writing q6_k blocks past
    the end of a q3_k row (what the dtype switch did before the traits table)."""
    n, code = 256, DTYPE_CODES["q3_k"]
    x = np.zeros(n, np.float32)  # (n,)
    out = np.zeros(LIB.fl_row_bytes(code, n), np.uint8)
    st = LIB.fl_quantize_row(code, ffi.cast("const float *", x.ctypes.data),
                             ffi.cast("void *", out.ctypes.data), n)
    assert st == LIB.FL_EUNSUPPORTED
