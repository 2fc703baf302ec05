"""Resident q4_k weights repacked 16 rows at a time (native/q4kpack.c, kernel.pack): the packed
matmul against gguf-py's dequantization of the same Q4_K bytes, on activations rounded to int8
as the kernel rounds them (per 256 values: llama.cpp's q8_K), up to f32 sums; and against the
unpacked matmul of the same weight."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from flashllm.errors import KernelError
from flashllm.ffi import kernel
from flashllm.model.tensor import QTensor
from test_convert_native import k_rows
from test_down_rows import int8

ROWS, COLS = 48, 512


@pytest.fixture(scope="module")
def weight():
    data = k_rows(np.random.default_rng(5), Q.Q4_K, ROWS, COLS)             # (ROWS, 288) uint8
    w = QTensor(np.ascontiguousarray(data), "q4_k", ROWS, COLS)
    ref = dequantize(data, Q.Q4_K).reshape(ROWS, COLS).astype(np.float64)  # (ROWS, COLS)
    return w, ref, kernel.pack(w)


def test_the_packed_values_are_the_weights(weight):
    w, _, p = weight
    if p is None:
        pytest.skip("this build has no packed layout (AVX-512 VNNI)")
    assert p.data.size == ROWS // 16 * COLS // 256 * 2368                  # +2.8% over 144 / 256
    assert (p.dtype, p.rows, p.cols) == ("q4_k", ROWS, COLS)


@pytest.mark.parametrize("T,threads", [(1, 1), (1, 2), (3, 2), (4, 1), (9, 2)])
def test_packed_matmul_against_gguf_py(weight, T, threads):
    w, ref, p = weight
    if p is None:
        pytest.skip("this build has no packed layout (AVX-512 VNNI)")
    rng = np.random.default_rng(T)
    x = rng.standard_normal((T, COLS)).astype(np.float32)                  # (T, COLS)
    bias = rng.standard_normal(ROWS).astype(np.float32)                    # (ROWS,)
    y = kernel.matmul(p, x, bias, threads)                                 # (T, ROWS)
    want = int8(x) @ ref.T + bias                                          # (T, ROWS) f64
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()
    plain = kernel.matmul(w, x, bias, threads)                             # the unpacked path
    assert np.abs(y - plain).max() <= 1e-5 * np.abs(plain).max()


def test_shapes_without_a_packed_layout_are_refused():
    other = QTensor(np.zeros((20, 144), np.uint8), "q4_k", 20, 256)        # rows not 16k
    assert kernel.pack(other) is None
    q8 = QTensor(np.zeros((16, 34 * 8), np.uint8), "q8_0", 16, 256)
    assert kernel.pack(q8) is None


def test_a_packed_weight_has_no_exact_path(weight):
    _, _, p = weight
    if p is None:
        pytest.skip("this build has no packed layout (AVX-512 VNNI)")
    with pytest.raises(KernelError, match="no exact"):
        kernel.matmul(p, np.zeros((1, COLS), np.float32), exact=True)
