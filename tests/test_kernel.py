"""The C compute kernel (through kernel.py) against float64 numpy references.

Quantized weights are dequantized by gguf-py for the reference, so every dtype must match the
f64 result to float32 accumulation error. matmul and ffn_bundles run with exact=True (f32
activations) here, except test_ffn_bundles_matches_numpy, which also runs the default int8 path
against x quantized in numpy (_quantize_x); the rest of the int8 path is in test_kernel_int8.py.
"""
import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GQ
from gguf.quants import dequantize, quantize

from flashllm.ffi import kernel
from flashllm.errors import KernelError
from flashllm.model.tensor import QTensor

DTYPES = ["f32", "f16", "q8_0", "q4_0", "q4_1"]
GGUF_TYPES = {"f32": GQ.F32, "f16": GQ.F16, "q8_0": GQ.Q8_0, "q4_0": GQ.Q4_0,
              "q4_1": GQ.Q4_1}


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _qtensor(rows: int, cols: int, dtype: str, seed: int) -> tuple[QTensor, np.ndarray]:
    """A random weight in dtype (gguf-py quantizer) and its f64 dequantized value."""
    w = _rng(seed).standard_normal((rows, cols)).astype(np.float32)  # (rows, cols)
    data = quantize(w, GGUF_TYPES[dtype]).view(np.uint8).reshape(rows, -1)  # (rows, row_bytes)
    ref = dequantize(data, GGUF_TYPES[dtype]).reshape(rows, cols).astype(np.float64)
    return QTensor(np.ascontiguousarray(data), dtype, rows, cols), ref


def _quantize_x(x: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """x (T, n) f32 -> (the f64 values the kernel's int8 activations stand for (T, n), the most
    a value moves per block (T, n / block)), by ggml's rule: q = nearest-even(x * (127 / amax))
    and d = amax / 127 kept in f16 per block of 32 (q8_0), d = 1 / (127 / amax) in f32 per
    256-value superblock (q8_K, the k-quants' operand). A value moves by at most
    d32 / 2 + 127 |d32 - d| (d32 = amax / 127 in f32)."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, block)  # (T, nb, block)
    amax = np.abs(xb).max(-1)  # (T, nb)
    inv = np.zeros_like(amax)  # (T, nb)
    np.divide(np.float32(127), amax, out=inv, where=amax != 0)
    q = np.rint(xb * inv[..., None])  # (T, nb, block) f32 products, ties to even
    d32 = (amax / np.float32(127)).astype(np.float32)  # (T, nb)
    d = d32.astype(np.float16).astype(np.float32) if block == 32 else \
        np.divide(np.float32(1), inv, out=np.zeros_like(inv), where=inv != 0)  # (T, nb)
    step = d32.astype(np.float64) / 2 + 127 * np.abs(d32.astype(np.float64) - d)  # (T, nb)
    return (q * d[..., None].astype(np.float64)).reshape(x.shape), step


def _close(got: np.ndarray, ref: np.ndarray, rel: float = 2e-5) -> None:
    """got matches ref to rel of ref's scale (float32 accumulation error)."""
    scale = max(float(np.abs(ref).max()), 1e-30)
    err = float(np.abs(got.astype(np.float64) - ref).max())
    assert got.shape == ref.shape
    assert err <= rel * scale, f"max error {err:.3g} > {rel} * {scale:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_matmul_matches_numpy(dtype, T, bias, threads):
    cols = 96 if dtype.startswith("q") else 83
    w, wref = _qtensor(37, cols, dtype, seed=T)  # (37, cols)
    x = _rng(7).standard_normal((T, cols)).astype(np.float32)  # (T, cols)
    b = _rng(8).standard_normal(37).astype(np.float32) if bias else None  # (37,)
    ref = x.astype(np.float64) @ wref.T + (b if bias else 0.0)  # (T, 37)
    _close(kernel.matmul(w, x, bias=b, n_threads=threads, exact=True), ref)


def test_matmul_vector_input_and_large_rows():
    w, wref = _qtensor(1031, 512, "q4_0", seed=3)  # (1031, 512)
    x = _rng(4).standard_normal(512).astype(np.float32)  # (512,)
    _close(kernel.matmul(w, x, n_threads=2, exact=True), wref @ x.astype(np.float64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_get_rows(dtype):
    w, wref = _qtensor(50, 64, dtype, seed=5)
    ids = np.array([3, 0, 49, 3], np.int32)
    np.testing.assert_array_equal(kernel.get_rows(w, ids), wref[ids].astype(np.float32))


def test_rmsnorm_and_layernorm():
    x = _rng(1).standard_normal((3, 77)).astype(np.float32) * 3 + 1  # (3, 77)
    w = _rng(2).standard_normal(77).astype(np.float32)  # (77,)
    b = _rng(3).standard_normal(77).astype(np.float32)  # (77,)
    xd = x.astype(np.float64)
    rms = xd / np.sqrt((xd**2).mean(1, keepdims=True) + 1e-6) * w
    _close(kernel.rmsnorm(x, w, 1e-6), rms)
    ln = (xd - xd.mean(1, keepdims=True)) / np.sqrt(xd.var(1, keepdims=True) + 1e-5) * w + b
    _close(kernel.layernorm(x, w, b, 1e-5), ln)
    _close(kernel.layernorm(x, w, None, 1e-5), ln - b)
    y = x.copy()
    kernel.rmsnorm(y, w, 1e-6, out=y)  # aliasing
    _close(y, rms)


@pytest.mark.parametrize("n", [1, 37, 256, 1001])
def test_logit_bounds_against_float64(n):
    """s +- (z sqrt(e @ var) + slack) with var in f16, over a tail that is no whole vector."""
    s = _rng(4).standard_normal(n).astype(np.float32)  # (n,)
    var = (_rng(5).random((3, n)) * 1e-3).astype(np.float16)  # (3, n)
    e = _rng(6).random(3).astype(np.float32) * 50  # (3,)
    dev = 4.0 * np.sqrt(e.astype(np.float64) @ var.astype(np.float64)) + 0.25  # (n,)
    hi, lo = kernel.logit_bounds(s, var, e, 4.0, 0.25)
    _close(hi, s + dev)
    _close(lo, s - dev)
    with pytest.raises(KernelError):
        kernel.logit_bounds(s, var.astype(np.float32), e, 4.0)


def _rope_ref(x: np.ndarray, pos: np.ndarray, inv: np.ndarray) -> np.ndarray:
    """Hugging Face rotate_half RoPE on the first n_rot = 2 * len(inv) values of every head, f64."""
    half = len(inv)
    n_rot = 2 * half
    ang = pos[:, None].astype(np.float64) * inv  # (T, half)
    cos = np.concatenate([np.cos(ang)] * 2, 1)[:, None, :]  # (T, 1, n_rot)
    sin = np.concatenate([np.sin(ang)] * 2, 1)[:, None, :]  # (T, 1, n_rot)
    xr = x[..., :n_rot].astype(np.float64)  # (T, H, n_rot)
    rot = np.concatenate([-xr[..., half:], xr[..., :half]], -1)  # (T, H, n_rot)
    return np.concatenate([xr * cos + rot * sin, x[..., n_rot:]], -1)


@pytest.mark.parametrize("n_rot", [16, 10])
@pytest.mark.parametrize("scaled", [False, True])
def test_rope_rotate_half(n_rot, scaled):
    """Plain frequencies theta^(-2j/n_rot), and the same divided per frequency (rope scaling)."""
    x = _rng(1).standard_normal((4, 3, 16)).astype(np.float32)  # (T, H, head_dim)
    pos = np.array([0, 1, 7, 300], np.int32)
    inv = 10000.0 ** (-np.arange(n_rot // 2) * 2.0 / n_rot)  # (n_rot/2,)
    if scaled:
        inv = inv / np.linspace(1.0, 8.0, n_rot // 2)
    ref = _rope_ref(x, pos, inv)
    _close(kernel.rope(x, pos, inv), ref, rel=1e-6)


def _attention_ref(q, k, v, pos0, scale, window=0, f16=False):
    """Causal softmax attention with grouped KV heads, f64; window > 0: the last `window` keys.
    f16: as llama.cpp meets an f16 cache (ggml converts a mul_mat's f32 operand to f16): q
    rounded to f16, the weights (softmax in f32) rounded to f16."""
    t, n_heads, hd = q.shape
    group = n_heads // k.shape[1]
    out = np.zeros((t, n_heads, hd))  # (T, H, hd)
    for i in range(t):
        n = pos0 + i + 1
        first = max(0, n - window) if window else 0       # keys of positions first .. n-1
        for h in range(n_heads):
            qh = q[i, h].astype(np.float16) if f16 else q[i, h]  # (hd,)
            s = scale * (k[first:n, h // group].astype(np.float64) @ qh)  # (n - first,)
            p = np.exp(s - s.max())
            p = p / p.sum()
            if f16:
                p = p.astype(np.float32).astype(np.float16).astype(np.float64)
            out[i, h] = p @ v[first:n, h // group]
    return out.reshape(t, n_heads * hd)


@pytest.mark.parametrize("T,pos0,n_heads,n_kv", [(1, 0, 4, 4), (1, 9, 6, 2), (5, 3, 6, 3),
                                                   (7, 0, 2, 1)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
def test_attention_causal_gqa(T, pos0, n_heads, n_kv, threads, kv_dtype):
    """f16 cache: llama.cpp's roundings (_attention_ref f16). An f32 softmax weight a few ulp
    from an f16 rounding boundary may round the other way than the f64 reference's (2^-11 of
    that weight), hence the max bound; the typical value is f32 summation noise."""
    hd, n_ctx = 24, 20
    rng = _rng(T + pos0)
    q = rng.standard_normal((T, n_heads, hd)).astype(np.float32)  # (T, H, hd)
    k = (rng.standard_normal((n_ctx, n_kv, hd)) * 4).astype(kv_dtype)  # (n_ctx, kv, hd)
    v = rng.standard_normal((n_ctx, n_kv, hd)).astype(kv_dtype)  # (n_ctx, kv, hd)
    got = kernel.attention(q, k, v, pos0, 1 / math.sqrt(hd), n_threads=threads)
    f16 = kv_dtype == np.float16
    ref = _attention_ref(q, k.astype(np.float32), v.astype(np.float32), pos0,
                         1 / math.sqrt(hd), f16=f16)
    if not f16:
        _close(got, ref)
        return
    err = np.abs(got - ref) / np.abs(ref).max()  # (T, H * hd)
    plain = np.abs(got - _attention_ref(q, k.astype(np.float32), v.astype(np.float32), pos0,
                                        1 / math.sqrt(hd))) / np.abs(ref).max()
    assert np.median(err) < 2e-6 and err.max() < 1e-3
    if pos0 + T > 1:                                 # one key: the weight is 1 either way
        assert np.median(plain) > 10 * np.median(err)  # the roundings are llama.cpp's


@pytest.mark.parametrize("T,pos0,window", [(1, 9, 4), (7, 0, 3), (6, 5, 1), (4, 2, 50)])
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_sliding_window(T, pos0, window, threads):
    """Each query sees only the keys of its last `window` positions (itself included)."""
    hd, n_ctx, n_heads, n_kv = 16, 16, 4, 2
    rng = _rng(T * 7 + window)
    q = rng.standard_normal((T, n_heads, hd)).astype(np.float32)  # (T, H, hd)
    k = (rng.standard_normal((n_ctx, n_kv, hd)) * 4).astype(np.float32)  # (n_ctx, kv, hd)
    v = rng.standard_normal((n_ctx, n_kv, hd)).astype(np.float32)  # (n_ctx, kv, hd)
    got = kernel.attention(q, k, v, pos0, 0.3, n_threads=threads, window=window)
    _close(got, _attention_ref(q, k, v, pos0, 0.3, window))
    if pos0 + T > window:
        assert not np.allclose(got, _attention_ref(q, k, v, pos0, 0.3))


def test_attention_refuses_mixed_or_other_kv_dtypes():
    q = np.zeros((1, 2, 8), np.float32)                                  # (T, H, hd)
    k = np.zeros((4, 1, 8), np.float16)                                  # (n_ctx, kv, hd)
    with pytest.raises(KernelError, match="must match"):
        kernel.attention(q, k, k.astype(np.float32), 0, 1.0)
    with pytest.raises(KernelError, match="float32 or float16"):
        kernel.attention(q, k.astype(np.float64), k.astype(np.float64), 0, 1.0)


def _act(name: str, z: np.ndarray) -> np.ndarray:
    if name == "silu":
        return z / (1 + np.exp(-z))
    if name == "gelu":
        return 0.5 * z * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))
    if name == "gelu_tanh":
        return 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))
    return np.maximum(z, 0)


def test_gelu_tanh_f16_is_ggmls_table():
    """"gelu_tanh_f16" is llama.cpp's CPU GELU (ggml's GGML_GELU_FP16 table): the tanh form of
    x rounded to f16, evaluated (f64 here) and rounded to f16; 0 below -10, x from 10 on. Each
    of the 63488 finite f16 inputs in (-10, 10) is checked; an f32 tanhf a hair from an f16
    rounding boundary may land on the other side: at most one f16 step, at a handful of inputs
    (and at the ties x / 2 meets among the f16 subnormals near 0)."""
    h = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)  # every f16
    x = h[np.isfinite(h) & (np.abs(h) < 10)].astype(np.float32)         # (n,) f16-exact inputs
    x = np.concatenate([x, np.float32([-10, -11, 10, 12.5, 0.1234567])])  # and f32 ones
    one = np.ones_like(x)                                               # gelu(x) * 1
    got = kernel.act_mul("gelu_tanh_f16", x, one)                       # (n,)
    xr = x.astype(np.float16).astype(np.float64)
    want = (0.5 * xr * (1 + np.tanh(math.sqrt(2 / math.pi) * xr * (1 + 0.044715 * xr * xr))))
    want = np.where(x <= -10, 0.0, np.where(x >= 10, x, want.astype(np.float16)))   # (n,)
    # one f16 step, and 1 + tanh's cancellation in f32 where tanh is near -1 (ggml's table is
    # made by the same f32 formula): up to |x| ulp(1) / 2
    step = np.abs(want) * 2.0 ** -10 + 2.0 ** -24 + np.abs(x) * 2.0 ** -23   # (n,)
    assert (np.abs(got - want) <= step).all()
    assert ((got != want) & (np.abs(want) > 1e-3)).sum() <= 20   # where neither tiny nor tied
    assert got[-1] != np.float32(_act("gelu_tanh", np.float64(0.1234567)))   # rounded, unlike
    assert np.abs(kernel.act_mul("gelu_tanh", x, one) - got).max() > 0      # "gelu_tanh"


def _bundles(n: int, d: int, dtype: str, glu: bool, pad: int, seed: int):
    """(n, stride) bundles [gate | up | down] and the f64 dequantized parts."""
    parts = [_qtensor(n, d, dtype, seed + j) for j in range(3 if glu else 2)]
    data = np.concatenate([p[0].data for p in parts] + [np.zeros((n, pad), np.uint8)], 1)
    return np.ascontiguousarray(data), [p[1] for p in parts]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("glu,act", [(True, "silu"), (True, "gelu"), (False, "relu"),
                                     (False, "gelu"), (True, "relu"), (True, "gelu_tanh")])
@pytest.mark.parametrize("T", [1, 3, 6])
@pytest.mark.parametrize("exact", [True, False])
def test_ffn_bundles_matches_numpy(dtype, glu, act, T, exact):
    """exact=False: q4_0 / q4_1 / q8_0 gate and up meet x quantized to int8 (reference: _quantize_x)."""
    d, n, n_ff = 64, 150, 400
    data, parts = _bundles(n, d, dtype, glu, pad=6, seed=11)
    rng = _rng(12)
    x = (rng.standard_normal((T, d)) / np.sqrt(d)).astype(np.float32)  # (T, d) pre-acts ~ 1
    ids = rng.choice(n_ff, n, replace=False).astype(np.int32)  # (n,)
    up_bias = rng.standard_normal(n_ff).astype(np.float32)  # (n_ff,)
    y0 = rng.standard_normal((T, d)).astype(np.float32)  # (T, d) the residual
    xd = x.astype(np.float64) if exact or not dtype.startswith("q") else _quantize_x(x)[0]
    up = xd @ parts[-2].T + up_bias[ids]  # (T, n)
    h = _act(act, xd @ parts[0].T) * up if glu else _act(act, up)  # (T, n)
    ref = y0 + h @ parts[-1]  # (T, d)
    for threads in (1, 2):
        y = y0.copy()
        kernel.ffn_bundles(data, dtype, d, glu, act, x, y, ids=ids, up_bias=up_bias,
                           n_threads=threads, exact=exact)
        _close(y, ref, rel=5e-5)


def test_ffn_bundles_without_ids_or_bias_and_empty():
    d, n = 32, 70
    data, parts = _bundles(n, d, "q8_0", True, pad=0, seed=3)
    x = _rng(1).standard_normal((2, d)).astype(np.float32)  # (2, d)
    xd = x.astype(np.float64)
    ref = (_act("silu", xd @ parts[0].T) * (xd @ parts[1].T)) @ parts[2]  # (2, d)
    y = np.zeros((2, d), np.float32)
    _close(kernel.ffn_bundles(data, "q8_0", d, True, "silu", x, y, n_threads=2, exact=True),
           ref, 5e-5)
    y = np.ones((2, d), np.float32)
    kernel.ffn_bundles(data[:0], "q8_0", d, True, "silu", x, y)
    np.testing.assert_array_equal(y, 1.0)


def _thresholded(h: np.ndarray, rows: np.ndarray, down: np.ndarray) -> tuple[float, np.ndarray]:
    """A threshold in the widest gap of the middle third of |h| over rows (no near ties) and the
    FFN output (T, d) of h (T, n) restricted to rows and to |h| >= it, through down (n, d)."""
    v = np.sort(np.abs(h[:, rows]).ravel())  # (T * m,)
    k = len(v) // 3 + int(np.argmax(np.diff(v[len(v) // 3: 2 * len(v) // 3])))
    thr = float(v[k] + v[k + 1]) / 2
    keep = np.zeros_like(h)  # (T, n)
    keep[:, rows] = np.abs(h[:, rows]) >= thr
    return thr, (h * keep) @ down


@pytest.mark.parametrize("dtype", ["f32", "q4_0", "q4_1"])
@pytest.mark.parametrize("T", [1, 4])
def test_ffn_bundles_rows_and_threshold(dtype, T):
    """rows gathers a subset of bundle rows; a term with |h| below threshold is dropped."""
    d, n, n_ff = 64, 120, 300
    data, parts = _bundles(n, d, dtype, True, pad=2, seed=21)
    rng = _rng(22)
    x = (rng.standard_normal((T, d)) / np.sqrt(d)).astype(np.float32)  # (T, d)
    ids = rng.choice(n_ff, n, replace=False).astype(np.int32)  # (n,)
    up_bias = rng.standard_normal(n_ff).astype(np.float32)  # (n_ff,)
    rows = np.sort(rng.choice(n, 37, replace=False)).astype(np.int32)[::-1].copy()  # (37,)
    xd = x.astype(np.float64)
    h = _act("silu", xd @ parts[0].T) * (xd @ parts[1].T + up_bias[ids])  # (T, n)
    thr, ref = _thresholded(h, rows, parts[2])
    for threads in (1, 2):
        y = np.zeros((T, d), np.float32)
        kernel.ffn_bundles(data, dtype, d, True, "silu", x, y, ids=ids, up_bias=up_bias,
                           rows=rows, threshold=thr, n_threads=threads, exact=True)
        _close(y, ref, rel=5e-5)
    with pytest.raises(KernelError):
        kernel.ffn_bundles(data, dtype, d, True, "silu", x, y, rows=[0, n])
    with pytest.raises(KernelError):
        kernel.ffn_bundles(data, dtype, d, True, "silu", x, y, threshold=-1.0)


def _bad_calls():
    w, _ = _qtensor(8, 32, "q8_0", seed=1)
    x = np.zeros((1, 32), np.float32)
    k = np.zeros((4, 2, 8), np.float32)
    data = np.zeros((4, 3 * 34), np.uint8)
    y = np.zeros((1, 32), np.float32)
    return [
        lambda: kernel.matmul(w, np.zeros((1, 31), np.float32)),
        lambda: kernel.matmul(w, x, bias=np.zeros(7, np.float32)),
        lambda: kernel.matmul(w, x, n_threads=0),
        lambda: kernel.get_rows(w, [8]),
        lambda: kernel.rmsnorm(x, np.zeros(31, np.float32), 1e-6),
        lambda: kernel.rope(np.zeros((1, 2, 8), np.float64), [0], np.ones(4)),
        lambda: kernel.rope(np.zeros((1, 2, 8), np.float32), [0], np.ones(5)),
        lambda: kernel.rope(np.zeros((1, 2, 8), np.float32), [0], np.zeros(4)),
        lambda: kernel.attention(np.zeros((1, 3, 8), np.float32), k, k, 0, 1.0),
        lambda: kernel.attention(np.zeros((2, 2, 8), np.float32), k, k, 3, 1.0),
        lambda: kernel.attention(np.zeros((1, 2, 8), np.float32), k, k, 0, 1.0, window=-1),
        lambda: kernel.ffn_bundles(data, "q8_0", 32, True, "tanh", x, y),
        lambda: kernel.ffn_bundles(data[:, :100], "q8_0", 32, True, "silu", x, y),
        lambda: kernel.ffn_bundles(data, "q8_0", 32, True, "silu", x, y.astype(np.float64)),
        lambda: kernel.ffn_bundles(data, "q8_0", 32, True, "silu", x, y, ids=[0, 1, 2, 9],
                                   up_bias=np.zeros(5, np.float32)),
    ]


@pytest.mark.parametrize("i", range(13))
def test_bad_arguments_raise_kernel_error(i):
    with pytest.raises(KernelError):
        _bad_calls()[i]()


def test_read_only_inputs_are_accepted_without_copies():
    w, wref = _qtensor(8, 32, "q4_0", seed=2)
    w.data.flags.writeable = False
    k = _rng(3).standard_normal((4, 1, 8)).astype(np.float32)  # (n_ctx, kv, hd)
    k.flags.writeable = False
    q = _rng(4).standard_normal((1, 2, 8)).astype(np.float32)  # (T, H, hd)
    x = np.ones(32, np.float32)
    _close(kernel.matmul(w, x, exact=True), wref @ np.ones(32))
    _close(kernel.attention(q, k, k, 3, 0.5), _attention_ref(q, k, k, 3, 0.5))


@pytest.mark.parametrize("dtype", ["q8_0", "q4_1", "f32"])
@pytest.mark.parametrize("T", [1, 3, 12, 300])
def test_ffn_bundles_gives_the_same_bits_on_any_number_of_threads(dtype, T):
    """Greedy output must not depend on -t: the FFN's sum is grouped by the work, not the threads."""
    n, d = 640, 128
    bundles, _ = _bundles(n, d, dtype, True, 0, seed=11)                        # (n, stride)
    x = _rng(T).standard_normal((T, d)).astype(np.float32)                      # (T, d)
    rows = np.sort(_rng(5).choice(n, 200, replace=False)).astype(np.int32)      # (200,)
    for sel, thr in ((None, 0.0), (None, 0.05), (rows, 0.05)):
        outs = [kernel.ffn_bundles(bundles, dtype, d, True, "silu", x, x.copy(), n_threads=k,
                                   rows=sel, threshold=thr) for k in (1, 2, 3, 5, 8)]
        for y in outs[1:]:
            np.testing.assert_array_equal(y, outs[0])
