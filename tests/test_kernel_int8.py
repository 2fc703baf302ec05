"""The int8-activation path of the C kernel (q4_0 / q4_1 / q8_0 weights, exact=False, the default).

The reference quantizes x in numpy by the rule flashllm.h states (ggml's q8_0: per block of 32
q = nearest-even(x * (127 / amax)), d = amax / 127 kept in f16) and multiplies the gguf-py
dequantized weights in f64, so on the same quantized inputs the kernel must agree to f32
accumulation error (2e-5 of the scale; the integer block sums are exact). A second test bounds
the distance to the exact f32 product by the rounding itself: each x value moves by at most
step = d32 / 2 + 127 |d32 - d| (d32 the f32 scale), so |int8 - exact| <= sum over blocks of
step * sum |w| — the tolerance the int8 path costs, and nothing more. (The plain FFN case, int8
and exact, is tests/test_kernel.py's test_ffn_bundles_matches_numpy.)
"""
import numpy as np
import pytest

from flashllm.errors import KernelError
from flashllm.ffi import kernel
from flashllm.model.tensor import row_bytes
from test_kernel import _act, _bundles, _close, _qtensor, _quantize_x, _rng, _thresholded

QDTYPES = ["q4_0", "q4_1", "q8_0"]


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("T", [1, 2, 5, 9])
@pytest.mark.parametrize("cols", [96, 256])
@pytest.mark.parametrize("threads", [1, 2])
def test_matmul_int8_matches_numpy_on_quantized_x(dtype, T, cols, threads):
    w, wref = _qtensor(37, cols, dtype, seed=T + cols)  # (37, cols)
    x = _rng(7).standard_normal((T, cols)).astype(np.float32)  # (T, cols)
    x[0, :32] = 0.0  # an all-zero block (d = 0)
    b = _rng(8).standard_normal(37).astype(np.float32)  # (37,)
    xq, _ = _quantize_x(x)
    _close(kernel.matmul(w, x, bias=b, n_threads=threads), xq @ wref.T + b)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_matmul_int8_error_is_bounded_by_activation_rounding(dtype):
    w, wref = _qtensor(203, 512, dtype, seed=4)  # (203, 512)
    x = (_rng(5).standard_normal((3, 512)) * np.linspace(0.1, 10, 512)).astype(np.float32)
    _, step = _quantize_x(x)  # (3, 16) the most a value of each block moves
    absw = np.abs(wref).reshape(203, 16, 32).sum(-1)  # (203, 16)
    bound = step @ absw.T  # (3, 203)
    exact = x.astype(np.float64) @ wref.T  # (3, 203)
    err = np.abs(kernel.matmul(w, x, n_threads=2) - exact)  # (3, 203)
    assert (err <= bound * (1 + 1e-4) + 1e-5 * np.abs(exact).max()).all()
    assert err.max() > 1e-3 * np.abs(exact).max()  # the int8 path really ran
    _close(kernel.matmul(w, x, n_threads=2, exact=True), exact)


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("T", [1, 2, 5, 9, 13])   # 2..10: per-token tiles; 13: GEMM panels
def test_ffn_bundles_int8_rows_and_threshold(dtype, T):
    d, n = 96, 130
    data, parts = _bundles(n, d, dtype, True, pad=2, seed=21)
    rng = _rng(22)
    x = (rng.standard_normal((T, d)) / np.sqrt(d)).astype(np.float32)  # (T, d)
    rows = rng.choice(n, 41, replace=False).astype(np.int32)  # (41,) any order
    xq, _ = _quantize_x(x)
    h = _act("silu", xq @ parts[0].T) * (xq @ parts[1].T)  # (T, n)
    thr, ref = _thresholded(h, rows, parts[2])  # ref (T, d)
    for threads in (1, 2):
        y = np.zeros((T, d), np.float32)
        kernel.ffn_bundles(data, dtype, d, True, "silu", x, y, rows=rows, threshold=thr,
                           n_threads=threads)
        _close(y, ref, rel=5e-5)


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_few_tokens_at_once_are_each_computed_as_one(dtype, threads):
    """A decode pass with draft guesses (T <= 5) gives each token, bit for bit, what a pass over
    that token alone gives: the guesses are checked against the decode's own numbers."""
    d, n = 96, 130
    data, _ = _bundles(n, d, dtype, True, pad=2, seed=23)
    rng = _rng(24)
    x = (rng.standard_normal((5, d)) / np.sqrt(d)).astype(np.float32)  # (5, d)
    rows = rng.choice(n, 77, replace=False).astype(np.int32)  # (77,)
    for T in (2, 3, 5):
        one = np.zeros((T, d), np.float32)
        for t in range(T):
            kernel.ffn_bundles(data, dtype, d, True, "silu", x[t:t + 1], one[t:t + 1], rows=rows,
                               threshold=0.01, n_threads=threads)
        many = np.zeros((T, d), np.float32)
        kernel.ffn_bundles(data, dtype, d, True, "silu", x[:T], many, rows=rows, threshold=0.01,
                           n_threads=threads)
        np.testing.assert_array_equal(many, one)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_a_few_tokens_through_matmul_are_each_computed_as_one(dtype):
    """A decode pass's tokens (up to 10: a token and its draft guesses, FL_SMALL_T) each get, bit
    for bit, their one-token product: int8 tiles of 4 tokens, never the prefill's panels (whose
    VNNI sums round otherwise), so a pass that verifies guesses gives each the logits decoding it
    alone would."""
    w, _ = _qtensor(70, 256, dtype, seed=25)                                  # (70, 256)
    x = _rng(26).standard_normal((10, 256)).astype(np.float32)                # (10, 256)
    for T in (2, 3, 4, 5, 7, 10):
        one = np.stack([kernel.matmul(w, x[t:t + 1], None, 2)[0] for t in range(T)])
        np.testing.assert_array_equal(kernel.matmul(w, x[:T], None, 2), one)



def _kq_bundles(n: int, d: int, seed: int, dtype: str = "q4_k") -> np.ndarray:
    """(n, stride) k-quant bundles [gate | up | down] of random rows (native/kquant.c quantizer)."""
    from flashllm.ffi.quant import quantize_rows
    rng = _rng(seed)
    return np.ascontiguousarray(np.concatenate(
        [quantize_rows(rng.standard_normal((n, d)).astype(np.float32), dtype)
         for _ in range(3)], 1))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["q4_k", "q6_k"])
def test_k_quant_tokens_at_once_are_each_computed_as_one(dtype, threads):
    """Q4_K and Q6_K (a native conversion's gate / up): a pass over T <= 10 tokens shares each
    superblock's unpacking among up to 4 of them (fli_q4k_tile, fli_q4k_tilen, fli_q6k_tile:
    ffn_quant.c's range_qs takes them in one tile) and still gives each token, bit for bit,
    its one-token numbers — in the FFN and in an unpacked matmul."""
    d, n = 512, 70
    data = _kq_bundles(n, d, seed=31, dtype=dtype)
    rng = _rng(32)
    x = (rng.standard_normal((7, d)) / np.sqrt(d)).astype(np.float32)  # (7, d)
    rows = rng.choice(n, 53, replace=False).astype(np.int32)  # (53,)
    for T in (2, 3, 4, 5, 7):
        one = np.zeros((T, d), np.float32)
        for t in range(T):
            kernel.ffn_bundles(data, dtype, d, True, "silu", x[t:t + 1], one[t:t + 1], rows=rows,
                               threshold=0.01, n_threads=threads, down_dtype=dtype)
        many = np.zeros((T, d), np.float32)
        kernel.ffn_bundles(data, dtype, d, True, "silu", x[:T], many, rows=rows, threshold=0.01,
                           n_threads=threads, down_dtype=dtype)
        np.testing.assert_array_equal(many, one)
    from flashllm.model.tensor import QTensor
    w = QTensor(np.ascontiguousarray(data[:, :data.shape[1] // 3]), dtype, n, d)  # (n, d)
    for T in (2, 3, 4):
        single = np.stack([kernel.matmul(w, x[t:t + 1], None, threads)[0] for t in range(T)])
        np.testing.assert_array_equal(kernel.matmul(w, x[:T], None, threads), single)


@pytest.mark.parametrize("threads", [1, 2])
def test_q2_k_tokens_at_once_are_each_computed_as_one(threads):
    """Q2_K (the output head's sketch, which a pass over T tokens multiplies by all of them):
    fli_q2k_tile unpacks each superblock once for up to 4 tokens and gives each, bit for bit,
    its one-token product."""
    from flashllm.ffi.quant import quantize_rows
    from flashllm.model.tensor import QTensor
    n, d = 37, 768
    rng = _rng(33)
    w = QTensor(quantize_rows(rng.standard_normal((n, d)).astype(np.float32), "q2_k"),
                "q2_k", n, d)                                                # (n, d)
    x = rng.standard_normal((4, d)).astype(np.float32)                       # (4, d)
    for T in (2, 3, 4):
        single = np.stack([kernel.matmul(w, x[t:t + 1], None, threads)[0] for t in range(T)])
        np.testing.assert_array_equal(kernel.matmul(w, x[:T], None, threads), single)


@pytest.mark.parametrize("dtype", ["q4_k", "q8_0", "q4_1", "f32"])
@pytest.mark.parametrize("glu", [True, False])
def test_down_columns_apart_give_the_bundles_bits(dtype, glu):
    """A resident cache keeps its gate / up rows apart from its down columns (NeuronCache.split):
    the FFN over the two arrays is the bundles' FFN bit for bit — every path (1, a few and many
    tokens, int8 and f32 x, a subset of rows, thresholds, threads)."""
    d, n = 256, 150
    rb = row_bytes(dtype, d)
    if dtype == "q4_k":                       # [gate | up | down], or [up | down]
        data = np.ascontiguousarray(_kq_bundles(n, d, seed=41)[:, 0 if glu else rb:])
    else:
        data, _ = _bundles(n, d, dtype, glu, pad=4, seed=41)                 # (n, stride)
    k = (2 if glu else 1) * rb
    head, down = np.ascontiguousarray(data[:, :k]), np.ascontiguousarray(data[:, k:])
    rng = _rng(42)
    rows = np.sort(rng.choice(n, 90, replace=False)).astype(np.int32)        # (90,)
    for T in (1, 3, 12):
        x = (rng.standard_normal((T, d)) / np.sqrt(d)).astype(np.float32)    # (T, d)
        for sel, exact, threads in ((None, False, 1), (rows, False, 2), (rows, True, 2)):
            kw = dict(rows=sel, threshold=0.02, exact=exact, n_threads=threads, down_dtype=dtype)
            whole = kernel.ffn_bundles(data, dtype, d, glu, "silu", x, np.zeros_like(x), **kw)
            apart = kernel.ffn_bundles(head, dtype, d, glu, "silu", x, np.zeros_like(x),
                                       down=down, **kw)
            assert np.any(whole != 0)
            np.testing.assert_array_equal(apart, whole)
    with pytest.raises(KernelError, match="down must be"):
        kernel.ffn_bundles(head, dtype, d, glu, "silu", x, np.zeros_like(x), down=down[:-1],
                           down_dtype=dtype)
    with pytest.raises(KernelError, match="below"):
        kernel.ffn_bundles(head, dtype, d, glu, "silu", x, np.zeros_like(x),
                           down=down[:, :8].copy(), down_dtype=dtype)
