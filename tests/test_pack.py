"""Resident q4_k, q6_k, q5_k, q2_k, q3_k, q8_0, q5_0 and q4_0 weights repacked 16 rows at a time
(native/pack.c and the layouts of q4kpack.c, q6kpack.c, q5kpack.c, q23pack.c, q0pack.c;
kernel.pack): the packed matmul against gguf-py's dequantization of the same bytes, on
activations rounded to int8 as the kernel rounds them (per 256 values for the k-quants:
llama.cpp's q8_K; per 32 for q8_0 / q5_0 / q4_0: its q8_0), up to f32 sums; and against the
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

# bytes of 256 values of 16 packed rows: q4_k +2.8% over 16 x 144 (scales unpacked); q6_k, q5_k,
# q2_k, q3_k, q8_0, q5_0, q4_0 the rows' own 16 x 210, 16 x 176, 16 x 84, 16 x 110, 16 x 8 x 34,
# 16 x 8 x 22, 16 x 8 x 18
GROUP_SB = {"q4_k": 2368, "q6_k": 3360, "q5_k": 2816, "q2_k": 1344, "q3_k": 1760, "q8_0": 4352,
            "q5_0": 2816, "q4_0": 2304}
TYPES = {"q4_k": Q.Q4_K, "q6_k": Q.Q6_K, "q5_k": Q.Q5_K, "q2_k": Q.Q2_K, "q3_k": Q.Q3_K,
         "q8_0": Q.Q8_0, "q5_0": Q.Q5_0, "q4_0": Q.Q4_0}
BLOCK = {Q.Q8_0: 34, Q.Q5_0: 22, Q.Q4_0: 18}   # bytes of a block of 32 (f16 d first)


def rows_of(rng, qtype, rows: int, cols: int) -> np.ndarray:
    """(rows, row bytes) uint8: random blocks (every value and qh bit pattern) with realistic f16
    scales."""
    if qtype not in BLOCK:
        return k_rows(rng, qtype, rows, cols)
    blk = rng.integers(0, 256, (rows, cols // 32, BLOCK[qtype]), dtype=np.uint8)
    d = rng.uniform(2e-4, 1e-3, (rows, cols // 32)).astype(np.float16)
    blk[..., :2] = d.view(np.uint8).reshape(rows, -1, 2)
    return blk.reshape(rows, -1)


def reference(data: np.ndarray, qtype, rows: int, cols: int) -> np.ndarray:
    """(rows, cols) float64: gguf-py's dequantization of the rows."""
    return dequantize(data, qtype).reshape(rows, cols).astype(np.float64)


def act_block(name: str) -> int:
    """The values per activation scale the kernel uses against a `name` weight."""
    return 256 if name.endswith("_k") else 32


@pytest.fixture(scope="module", params=list(TYPES))
def weight(request):
    name = request.param
    data = rows_of(np.random.default_rng(5), TYPES[name], ROWS, COLS)      # (ROWS, row bytes) uint8
    w = QTensor(np.ascontiguousarray(data), name, ROWS, COLS)
    return w, reference(data, TYPES[name], ROWS, COLS), kernel.pack(w)


def test_the_packed_values_are_the_weights(weight):
    w, _, p = weight
    if p is None:
        pytest.skip("this build has no packed layout (AVX-512 VNNI)")
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
    want = int8(x, act_block(w.dtype)) @ ref.T + bias                      # (T, ROWS) f64
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()
    plain = kernel.matmul(w, x, bias, threads)                             # the unpacked path
    assert np.abs(y - plain).max() <= 1e-5 * np.abs(plain).max()


@pytest.mark.parametrize("T,threads", [(1, 1), (2, 2), (5, 1)])
@pytest.mark.parametrize("name", ["q8_0", "q5_0"])
def test_an_odd_number_of_blocks(name, T, threads):
    """7 blocks of 32 a row: the values of a group no longer start on a cache line."""
    rows, cols = 32, 224
    data = rows_of(np.random.default_rng(11), TYPES[name], rows, cols)     # (rows, row bytes)
    p = kernel.pack(QTensor(data, name, rows, cols))
    if p is None:
        pytest.skip("this build has no packed layout (AVX-512 VNNI)")
    x = np.random.default_rng(T).standard_normal((T, cols)).astype(np.float32)  # (T, cols)
    want = int8(x, 32) @ reference(data, TYPES[name], rows, cols).T      # (T, rows) f64
    y = kernel.matmul(p, x, None, threads)                                 # (T, rows)
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()


def test_shapes_without_a_packed_layout_are_refused():
    other = QTensor(np.zeros((20, 144), np.uint8), "q4_k", 20, 256)        # rows not 16k
    assert kernel.pack(other) is None
    for name, bb in (("q8_0", 34), ("q5_0", 22), ("q4_0", 18), ("q4_1", 20)):  # q4_1: no layout
        rows = 20 if name != "q4_1" else 16
        assert kernel.pack(QTensor(np.zeros((rows, bb * 8), np.uint8), name, rows, 256)) is None


def test_a_packed_weight_has_no_exact_path(weight):
    _, _, p = weight
    if p is None:
        pytest.skip("this build has no packed layout (AVX-512 VNNI)")
    with pytest.raises(KernelError, match="no exact"):
        kernel.matmul(p, np.zeros((1, COLS), np.float32), exact=True)


@pytest.mark.parametrize("name", ["q6_k", "q5_k", "q2_k", "q3_k", "q8_0", "q5_0", "q4_0"])
def test_packs_in_place_to_the_same_bytes(name):
    """A q6_k, q5_k, q2_k, q3_k, q8_0, q5_0 or q4_0 layout is as large as its rows: packed over them
    (no second copy of a large head), it is the layout a separate array gets, and w's array now
    holds it."""
    data = rows_of(np.random.default_rng(9), TYPES[name], ROWS, COLS)      # (ROWS, row bytes)
    apart = kernel.pack(QTensor(data.copy(), name, ROWS, COLS))
    if apart is None:
        pytest.skip("this build has no packed layout (AVX-512 VNNI)")
    w = QTensor(data, name, ROWS, COLS)
    got = kernel.pack(w, in_place=True)
    assert np.shares_memory(got.data, data)
    np.testing.assert_array_equal(got.data.reshape(-1), apart.data.reshape(-1))


@pytest.mark.parametrize("name", ["q2_k", "q3_k", "q5_k"])
def test_the_largest_sub_block_dots(name):
    """Every value at its largest (Q2_K u = 3, Q3_K 7, Q5_K 31) against activations all 127 or
    all -127: a Q2_K / Q3_K sub-block's dot (16 x 7 x 127) is the largest the kernel pairs into
    int16."""
    rows, cols = 16, 512
    data = rows_of(np.random.default_rng(3), TYPES[name], rows, cols)     # (rows, row bytes)
    sb = data.reshape(rows, cols // 256, -1)                              # (rows, 2, sb bytes)
    values = {"q2_k": slice(16, 80), "q3_k": slice(0, 96), "q5_k": slice(16, 176)}[name]
    sb[:, :, values] = 0xFF
    p = kernel.pack(QTensor(data, name, rows, cols))
    if p is None:
        pytest.skip("this build has no packed layout (AVX-512 VNNI)")
    x = np.stack([np.ones(cols), -np.ones(cols)]).astype(np.float32)      # (2, cols)
    want = x.astype(np.float64) @ reference(data, TYPES[name], rows, cols).T  # (2, rows)
    y = kernel.matmul(p, x, None, 1)                                      # (2, rows)
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()


UNPACKS = {"q4_k", "q6_k", "q8_0", "q5_0", "q4_0"}   # the layouts fl_unpack_rows undoes


def test_unpacked_rows_are_the_rows_as_on_file(weight):
    w, ref, p = weight
    if p is None:
        pytest.skip("this build has no packed layout (AVX-512 VNNI)")
    ids = np.array([0, 47, 17, 17, 5, 31, 16, 15])                        # (8,)
    if w.dtype not in UNPACKS:
        assert not kernel.unpacks(w.dtype, ROWS, COLS)
        with pytest.raises(KernelError):
            kernel.unpack_rows(p, ids)
        return
    assert kernel.unpacks(w.dtype, ROWS, COLS)
    got = kernel.unpack_rows(p, ids)                                      # QTensor (8, COLS)
    np.testing.assert_array_equal(got.data, w.data[ids])                  # the bytes as written
    emb = kernel.get_rows(got, np.arange(len(ids)))                       # (8, COLS)
    np.testing.assert_allclose(emb, ref[ids], rtol=1e-6, atol=1e-7)       # gguf-py's values
    with pytest.raises(KernelError):
        kernel.unpack_rows(p, [ROWS])
