"""q5_0, q5_1, q5_k, q6_k, q2_k and q3_k: the ggml types a GGUF's tensors keep in a native
conversion (q2_k is also the output head sketch's type).

The reference is gguf-py: its `dequantize` for every type (the kernel's dequantization must equal
it bit for bit) and its `quantize` for q5_0 / q5_1 (flashllm's quantizer too). The int8 products
are checked against numpy in f64 on the gguf-py dequantized weights and on the int8 activations
the kernel makes by the rule flashllm.h states (ggml's: d = amax / 127 per 32 values in f16,
per 256 for the k-quants; q = nearest-even(x * 127 / amax); test_kernel._quantize_x): the
integer sums are exact, so they agree to f32 accumulation error
(1e-5 of the scale). Every instruction set the kernel has a path for is built and run too (the
extension itself is built for this CPU only).
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from flashllm.errors import KernelError
from flashllm.ffi import kernel
from flashllm.ffi.quant import dequantize_rows, quantize_rows
from flashllm.model.tensor import QTensor, row_bytes
from test_kernel_isa import ISAS
from test_kernel import _quantize_x
from test_q4_k import _isa_lib, silu

GG = {"q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K, "q8_0": Q.Q8_0,
      "q4_1": Q.Q4_1, "q4_k": Q.Q4_K, "q2_k": Q.Q2_K, "q3_k": Q.Q3_K}
NEW = ["q5_0", "q5_1", "q5_k", "q6_k"]
DENSE = NEW + ["q2_k", "q3_k"]  # types of rows the dense kernels (dequantize, matmul) take
BUNDLED = NEW + ["q2_k", "q3_k"]  # types of gate / up rows in bundles
KQ = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
D = 512


def rows_of(dtype: str, rng, rows: int, cols: int) -> np.ndarray:
    """(rows, row_bytes) uint8 of dtype: gguf-py's quantization of random weights, or for the
    k-quants (no gguf-py quantizer) random blocks with realistic f16 scales."""
    if dtype not in KQ:
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05    # (rows, cols)
        return quantize(w, GG[dtype]).view(np.uint8).reshape(rows, -1)
    nb, bb = cols // 256, row_bytes(dtype, 256)
    blk = rng.integers(0, 256, (rows, nb, bb), dtype=np.uint8)           # (rows, nb, bb)
    at = {"q6_k": (208,), "q2_k": (80, 82), "q3_k": (108,)}.get(dtype, (0, 2))          # d / d, dmin
    for a in at:
        f = rng.uniform(2e-4, 1e-3, (rows, nb)).astype(np.float16)       # (rows, nb)
        blk[..., a:a + 2] = f.view(np.uint8).reshape(rows, nb, 2)
    return blk.reshape(rows, nb * bb)


def ref_of(dtype: str, data: np.ndarray, cols: int) -> np.ndarray:
    return dequantize(data, GG[dtype]).reshape(data.shape[0], cols).astype(np.float64)


def int8_of(dtype: str, x: np.ndarray) -> np.ndarray:
    """x (T, n) as the kernel's int8 activations for dtype's weights see it, f64."""
    return _quantize_x(x, 256 if dtype.endswith("_k") else 32)[0]


def close(got, ref, what=""):
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), what


@pytest.mark.parametrize("dtype", DENSE)
def test_dequantize_equals_gguf_py_bit_for_bit(dtype):
    data = rows_of(dtype, np.random.default_rng(1), 9, D)                  # (9, row_bytes)
    got = dequantize_rows(data, dtype, D)                                  # (9, D)
    np.testing.assert_array_equal(got.view(np.uint32),
                                  ref_of(dtype, data, D).astype(np.float32).view(np.uint32))
    ids = np.array([4, 0, 8, 4], np.int32)
    np.testing.assert_array_equal(kernel.get_rows(QTensor(data, dtype, 9, D), ids), got[ids])


@pytest.mark.parametrize("dtype", ["q5_0", "q5_1"])
def test_quantize_equals_gguf_py_bit_for_bit(dtype):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((17, 288)).astype(np.float32) * rng.uniform(0.01, 3, (17, 1))
    w[3, :32] = 0.0                                                        # d = 0
    w[4, 32:64] = 0.25                                                     # max == min
    w = w.astype(np.float32)
    np.testing.assert_array_equal(quantize_rows(w, dtype),
                                  quantize(w, GG[dtype]).view(np.uint8).reshape(17, -1))


def test_k_quant_rows_are_whole_superblocks():
    for dtype in KQ:
        with pytest.raises(KernelError):
            quantize_rows(np.zeros((1, 288), np.float32), dtype)
        with pytest.raises(KernelError):
            row_bytes(dtype, 288)
    assert row_bytes("q6_k", 1536) == 1260 and row_bytes("q5_k", 1536) == 1056


@pytest.mark.parametrize("dtype", DENSE)
@pytest.mark.parametrize("T", [1, 2, 3, 5, 9])
def test_matmul_int8_and_exact_against_numpy(dtype, T):
    rng = np.random.default_rng(T)
    w = rows_of(dtype, rng, 37, D)                                         # (37, row_bytes)
    wref = ref_of(dtype, w, D)                                             # (37, D)
    x = rng.standard_normal((T, D)).astype(np.float32)                     # (T, D)
    x[0, :32] = 0.0                                                        # an all-zero block
    b = rng.standard_normal(37).astype(np.float32)                         # (37,)
    for threads in (1, 2):
        close(kernel.matmul(QTensor(w, dtype, 37, D), x, bias=b, n_threads=threads),
              int8_of(dtype, x) @ wref.T + b)
    close(kernel.matmul(QTensor(w, dtype, 37, D), x, exact=True), x.astype(np.float64) @ wref.T)


@pytest.mark.parametrize("dtype", DENSE)
def test_int8_error_is_bounded_by_activation_rounding(dtype):
    """|int8 - exact| <= sum over blocks of d / 2 * sum |w|: the int8 path costs its rounding."""
    rng = np.random.default_rng(3)
    w = rows_of(dtype, rng, 64, D)
    wref = ref_of(dtype, w, D)                                             # (64, D)
    x = (rng.standard_normal((2, D)) * np.linspace(0.1, 10, D)).astype(np.float32)
    blk = 256 if dtype in KQ else 32
    xq, d2 = _quantize_x(x, blk)                        # d2 (2, nb): the most a value moves
    step = np.abs(xq - x)                                                  # (2, D) <= d2
    assert (step.reshape(2, -1, blk).max(-1) <= d2 * (1 + 1e-6)).all()
    bound = d2 @ np.abs(wref).reshape(64, -1, blk).sum(-1).T               # (2, 64)
    exact = x.astype(np.float64) @ wref.T
    err = np.abs(kernel.matmul(QTensor(w, dtype, 64, D), x) - exact)
    assert (err <= bound * (1 + 1e-4) + 1e-5 * np.abs(exact).max()).all()


def bundles_of(dtype: str, down: str, n: int, seed: int):
    """(n, stride) bundles [gate | up | down] and their f64 values (gate, up, down (n, D))."""
    rng = np.random.default_rng(seed)
    g, u, dn = rows_of(dtype, rng, n, D), rows_of(dtype, rng, n, D), rows_of(down, rng, n, D)
    stride = -(-(g.shape[1] * 2 + dn.shape[1]) // 32) * 32
    data = np.zeros((n, stride), np.uint8)                                 # (n, stride)
    data[:, :g.shape[1] * 2 + dn.shape[1]] = np.concatenate([g, u, dn], axis=1)
    return data, (ref_of(dtype, g, D), ref_of(dtype, u, D), ref_of(down, dn, D))


@pytest.mark.parametrize("dtype", BUNDLED)
@pytest.mark.parametrize("down", ["q8_0", "q5_1", "q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("T", [1, 3, 13])
def test_ffn_bundles_against_numpy(dtype, down, T):
    data, (g, u, dn) = bundles_of(dtype, down, 70, seed=T)
    x = np.random.default_rng(T + 1).standard_normal((T, D)).astype(np.float32)
    rows = np.arange(2, 70, 3, dtype=np.int32)                             # gathered slots
    mask = np.zeros(70)
    mask[rows] = 1
    for exact, xr in ((False, int8_of(dtype, x)), (True, x.astype(np.float64))):
        y = np.zeros((T, D), np.float32)
        kernel.ffn_bundles(data, dtype, D, True, "silu", x, y, rows=rows, n_threads=2,
                           exact=exact, down_dtype=down)
        close(y, (silu(xr @ g.T) * (xr @ u.T) * mask) @ dn)


@pytest.mark.parametrize("isa", list(ISAS))
def test_every_instruction_set(isa):
    ffi, lib = _isa_lib(isa)
    f32 = lambda a: ffi.cast("float *", ffi.from_buffer(a))  # noqa: E731
    for code, dtype in ((5, "q4_k"), (6, "q5_0"), (7, "q5_1"), (8, "q5_k"), (9, "q6_k")):
        kq = dtype.endswith("_k")
        down = dtype if kq else "q5_1"                                    # k-quant columns too
        data, (g, u, dn) = bundles_of(dtype, down, 40, seed=code)
        w = np.ascontiguousarray(data[:, :row_bytes(dtype, D)])           # (40, row_bytes)
        out = np.zeros(D, np.float32)
        assert lib.fl_dequantize_row(code, ffi.from_buffer(w[3]), f32(out), D) == 0
        np.testing.assert_array_equal(out, g[3].astype(np.float32))
        for T in (1, 5, 13):
            x = np.random.default_rng(T).standard_normal((T, D)).astype(np.float32)
            xr = int8_of(dtype, x)
            y = np.zeros((T, 40), np.float32)
            assert lib.fl_matmul(ffi.from_buffer(w), code, 40, D, ffi.NULL, f32(x), T, f32(y),
                                 0, 2) == 0
            close(y, xr @ g.T, (isa, dtype, T))
            layer = ffi.new("fl_ffn_layer *", {"bundles": ffi.from_buffer(data), "n": 40,
                                               "stride": data.shape[1], "dtype": code,
                                               "down_dtype": code if kq else 7, "d": D, "glu": 1,
                                               "act": 0})
            y = np.zeros((T, D), np.float32)
            assert lib.fl_ffn_bundles(layer, ffi.NULL, 0, 0.0, f32(x), T, f32(y), 0, 2) == 0
            close(y, (silu(xr @ g.T) * (xr @ u.T)) @ dn, (isa, dtype, T))


@pytest.mark.parametrize("down", ["q4_k", "q5_k", "q6_k"])
def test_k_quant_down_columns_in_groups_of_one_to_four(down):
    """kaxpy.c adds up to 4 down columns at once (AVX-512: values unpacked a superblock at a
    time, one accumulator per 16 values): every group size and tail, against gguf-py."""
    data, (g, u, dn) = bundles_of("q4_k", down, 24, seed=11)
    x = np.random.default_rng(5).standard_normal((1, D)).astype(np.float32)
    for n in range(1, 10):                                                 # 2 groups + 0..3 tail
        rows = np.arange(24 - n, 24, dtype=np.int32)[::-1].copy()          # (n,) gathered, unsorted
        mask = np.zeros(24)
        mask[rows] = 1
        y = np.full((1, D), 0.25, np.float32)                              # y is added to
        kernel.ffn_bundles(data, "q4_k", D, True, "silu", x, y, rows=rows, exact=True,
                           down_dtype=down)
        xr = x.astype(np.float64)
        close(y, 0.25 + (silu(xr @ g.T) * (xr @ u.T) * mask) @ dn, (down, n))


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("dtype, code", [("q2_k", 10), ("q3_k", 11)])
def test_q2_k_q3_k_rows_on_every_instruction_set(isa, dtype, code):
    """q2_k / q3_k dequantization and int8 matmul (qk.c's and q3k.c's AVX-512, AVX2 and plain C
    sums) against gguf-py's values, one build per instruction set."""
    ffi, lib = _isa_lib(isa)
    f32 = lambda a: ffi.cast("float *", ffi.from_buffer(a))  # noqa: E731
    w = rows_of(dtype, np.random.default_rng(10), 40, D)                   # (40, row_bytes)
    ref = ref_of(dtype, w, D)                                              # (40, D)
    out = np.zeros(D, np.float32)
    assert lib.fl_dequantize_row(code, ffi.from_buffer(w[3]), f32(out), D) == 0
    np.testing.assert_array_equal(out, ref[3].astype(np.float32))
    for T in (1, 5):
        x = np.random.default_rng(T).standard_normal((T, D)).astype(np.float32)
        y = np.zeros((T, 40), np.float32)
        assert lib.fl_matmul(ffi.from_buffer(w), code, 40, D, ffi.NULL, f32(x), T, f32(y), 0,
                             2) == 0
        close(y, int8_of(dtype, x) @ ref.T, (isa, T))
