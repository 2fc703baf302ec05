"""The q2_k, q4_k, q5_k and q6_k quantizer (native/kquant.c) against ggml itself: llama.cpp's library
(llama-cpp-python's libggml-base) quantizes the same random rows with ggml_quantize_chunk (no
importance matrix: ggml's quantize_row_q*_K_ref), and the bytes must be equal, for rows of many
scales, all-zero superblocks and sub-blocks, one-signed rows and heavy tails. gguf-py's
dequantization of those bytes must then be within the type's grid of the input.
"""

import ctypes
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from flashllm.ffi.quant import quantize_rows
from flashllm.model.tensor import row_bytes

GGML = {"q2_k": Q.Q2_K, "q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}


def ggml_lib():
    """libggml-base of the installed llama_cpp package with ggml_quantize_chunk typed, or skip."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    if not path.exists():
        pytest.skip(f"no {path.name} in the llama_cpp package")
    lib = ctypes.CDLL(str(path))
    f = lib.ggml_quantize_chunk
    f.restype = ctypes.c_size_t
    f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_int64, ctypes.c_void_p]
    return f


def ggml_quantize(x: np.ndarray, dtype: str) -> np.ndarray:
    """x (rows, n) f32 quantized by ggml: (rows, row_bytes) uint8."""
    rows, n = x.shape
    out = np.zeros((rows, row_bytes(dtype, n)), np.uint8)                # (rows, row_bytes)
    got = ggml_lib()(int(GGML[dtype]), x.ctypes.data, out.ctypes.data, 0, rows, n, None)
    assert got == out.nbytes
    return out


def cases(rng) -> dict[str, np.ndarray]:
    """Named (rows, 1536) f32 inputs."""
    scale = rng.uniform(1e-4, 5, (48, 1))                                # (48, 1)
    x = (rng.standard_normal((48, 1536)) * scale).astype(np.float32)      # (48, 1536)
    zero = x.copy()
    zero[:, :256] = 0.0                                                  # a whole superblock
    zero[:, 300:316] = 0.0                                               # a q6_k sub-block
    zero[:, 512:544] = 0.0                                               # a q4_k / q5_k sub-block
    flat = x.copy()
    flat[:, 600:632] = 0.125                                             # max == min
    return {"normal": x, "zeros": zero, "flat": flat, "positive": np.abs(x),
            "negative": -np.abs(x),
            "heavy": (rng.standard_t(2, (48, 1536)) * scale).astype(np.float32),
            "tiny": (x * 1e-6).astype(np.float32)}


@pytest.mark.parametrize("dtype", list(GGML))
def test_quantize_equals_ggml_bit_for_bit(dtype):
    for name, x in cases(np.random.default_rng(7)).items():
        np.testing.assert_array_equal(quantize_rows(x, dtype), ggml_quantize(x, dtype),
                                      err_msg=f"{dtype} {name}")


@pytest.mark.parametrize("dtype, levels", [("q2_k", 3), ("q4_k", 15), ("q5_k", 31), ("q6_k", 63)])
def test_gguf_py_reads_it_back_within_the_grid(dtype, levels):
    """Each value is within about one step of its block's grid (step = block range / levels)."""
    x = cases(np.random.default_rng(8))["normal"]                          # (48, 1536)
    back = dequantize(quantize_rows(x, dtype), GGML[dtype]).reshape(x.shape)
    blk = 16 if dtype in ("q2_k", "q6_k") else 32
    xs = x.reshape(48, -1, blk)
    step = (xs.max(-1) - np.minimum(xs.min(-1), 0)) / levels               # (48, nb)
    if dtype == "q6_k":
        step = 2 * np.abs(xs).max(-1) / levels
    err = np.abs(back - x).reshape(48, -1, blk).max(-1)                  # (48, nb)
    assert (err <= (2.5 if dtype == "q2_k" else 1.5) * step + 1e-6).all()  # q2_k: 4-bit scales
    rel = np.linalg.norm(back - x) / np.linalg.norm(x)
    assert rel < {"q2_k": 0.45, "q4_k": 0.1, "q5_k": 0.05, "q6_k": 0.025}[dtype]
