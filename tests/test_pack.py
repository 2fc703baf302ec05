"""Resident q4_k and q6_k weights repacked 16 rows at a time (native/q4kpack.c, q6kpack.c,
kernel.pack): the packed matmul against gguf-py's dequantization of the same bytes, on activations rounded to int8
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


GROUP_SB = {"q4_k": 2368, "q6_k": 3360}   # bytes of a superblock of 16 packed rows


@pytest.fixture(scope="module", params=[(Q.Q4_K, "q4_k"), (Q.Q6_K, "q6_k")], ids=["q4_k", "q6_k"])
def weight(request):
    qtype, name = request.param
    data = k_rows(np.random.default_rng(5), qtype, ROWS, COLS)              # (ROWS, row bytes) uint8
    w = QTensor(np.ascontiguousarray(data), name, ROWS, COLS)
    ref = dequantize(data, qtype).reshape(ROWS, COLS).astype(np.float64)   # (ROWS, COLS)
    return w, ref, kernel.pack(w)


def test_the_packed_values_are_the_weights(weight):
    w, _, p = weight
    if p is None:
        pytest.skip("this build has no packed layout (AVX-512 VNNI)")
    # q4_k +2.8% over 144 / 256 (scales unpacked), q6_k the rows' own 210 bytes a superblock
    assert p.data.size == ROWS // 16 * COLS // 256 * GROUP_SB[w.dtype]
    assert (p.dtype, p.rows, p.cols) == (w.dtype, ROWS, COLS)


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


def test_q6_k_packs_in_place_to_the_same_bytes():
    """A q6_k layout is as large as its rows: packed over them (no second copy of a large head),
    it is the layout a separate array gets, and w's array now holds it."""
    data = k_rows(np.random.default_rng(9), Q.Q6_K, ROWS, COLS)             # (ROWS, 210 * COLS / 256)
    apart = kernel.pack(QTensor(data.copy(), "q6_k", ROWS, COLS))
    if apart is None:
        pytest.skip("this build has no packed layout (AVX-512 VNNI)")
    w = QTensor(data, "q6_k", ROWS, COLS)
    got = kernel.pack(w, in_place=True)
    assert np.shares_memory(got.data, data)
    np.testing.assert_array_equal(got.data.reshape(-1), apart.data.reshape(-1))
