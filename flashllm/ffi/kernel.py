"""The only module that calls the compute half of the cffi extension (flashllm.ffi._native).

Thin typed wrappers: they check shapes, dtypes and contiguity (KernelError with a clear message,
never a crash), pass numpy buffers without copying when they are already contiguous float32,
and turn C status codes into KernelError. The GIL is released during every C call.
"""
from __future__ import annotations

import numpy as np

from flashllm.errors import KernelError
from flashllm.model.tensor import PackedTensor, QTensor, companion, dtype_code, row_bytes

from flashllm.ffi.lib import check as _check, ffi, native as _native

ACT_CODES = {"silu": 0, "gelu": 1, "relu": 2, "gelu_tanh": 3, "gelu_tanh_f16": 4}
def _as_f32(a, name: str, ndim: int) -> np.ndarray:
    """a as a C-contiguous float32 array of ndim dims (copied only when it is not one already)."""
    arr = np.ascontiguousarray(a, dtype=np.float32)
    if arr.ndim != ndim:
        raise KernelError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    return arr


def _big_f32(a, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """a must already be a C-contiguous float32 array of exactly this shape (never copied)."""
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or not a.flags.c_contiguous:
        raise KernelError(f"{name} must be a C-contiguous float32 numpy array")
    if a.shape != shape:
        raise KernelError(f"{name} must have shape {shape}, got {a.shape}")
    return a


def _out_f32(a, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """a must already be a writable C-contiguous float32 array of exactly this shape."""
    if not _big_f32(a, name, shape).flags.writeable:
        raise KernelError(f"{name} must be writable")
    return a


def _ids(ids, name: str, upper: int) -> np.ndarray:
    """ids as a contiguous int32 vector with every value in [0, upper)."""
    arr = np.ascontiguousarray(ids, dtype=np.int32).reshape(-1)  # (n,)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= upper):
        raise KernelError(f"{name} must lie in [0, {upper}), got [{arr.min()}, {arr.max()}]")
    return arr


def _fptr(a: np.ndarray):
    return ffi.from_buffer("float[]", a)


def _threads(n_threads: int) -> int:
    if int(n_threads) < 1:
        raise KernelError(f"n_threads must be at least 1, got {n_threads}")
    return int(n_threads)


def quantize_row(x, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """x (n) float32 -> (row_bytes(dtype, n)) uint8, ggml reference rounding (q4_1: the step
    search of fl_quantize_row)."""
    k = _native()
    src = _as_f32(x, "x", 1)  # (n,)
    nb = row_bytes(dtype, src.size)
    dst = np.empty(nb, np.uint8) if out is None else out  # (nb,)
    if dst.dtype != np.uint8 or dst.shape != (nb,) or not dst.flags.c_contiguous:
        raise KernelError(f"out must be a contiguous uint8 array of shape ({nb},)")
    _check(k.fl_quantize_row(dtype_code(dtype), _fptr(src), ffi.from_buffer(dst), src.size),
           "quantize_row")
    return dst


def dequantize_row(data, dtype: str, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """data (row_bytes(dtype, n)) uint8 -> (n) float32."""
    k = _native()
    src = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)  # (nb,)
    if src.size != row_bytes(dtype, n):
        raise KernelError(f"a {dtype} row of {n} values has {row_bytes(dtype, n)} bytes, "
                          f"got {src.size}")
    dst = np.empty(n, np.float32) if out is None else _out_f32(out, "out", (n,))  # (n,)
    _check(k.fl_dequantize_row(dtype_code(dtype), ffi.from_buffer(src), _fptr(dst), n),
           "dequantize_row")
    return dst


def get_rows(w: QTensor, ids) -> np.ndarray:
    """(n, cols) float32: rows ids of w, dequantized (embedding lookup)."""
    k = _native()
    idx = _ids(ids, "ids", w.rows)  # (n,)
    out = np.empty((idx.size, w.cols), np.float32)  # (n, cols)
    if idx.size:
        _check(k.fl_get_rows(ffi.from_buffer(w.data), w.code, w.rows, w.cols,
                             ffi.from_buffer("int32_t[]", idx), idx.size, _fptr(out)),
               "get_rows")
    return out


def packed_nbytes(dtype: str, rows: int, cols: int) -> int:
    """Bytes of a (rows, cols) `dtype` matrix repacked by pack(); 0 when this build has no packed
    layout for it (it stays as it is)."""
    return int(_native().fl_packed_bytes(dtype_code(dtype), rows, cols))


def pack(w: QTensor, in_place: bool = False) -> PackedTensor | None:
    """w repacked for this build's resident matmul (fl_pack: q4_k, q6_k, q5_k, q2_k and q3_k rows
    16 at a time under AVX-512 VNNI, q8_0, q5_0 and q4_0 under AVX-512 VNNI or AVX2), or None when
    the build or w has no packed layout (use w as it is). in_place: a layout of w's own size (all
    but q4_k's) is written over w's bytes (w is then spent), so packing a large matrix takes no
    second copy; other layouts get a new array."""
    k = _native()
    n = k.fl_packed_bytes(w.code, w.rows, w.cols)
    if n == 0:
        return None
    if in_place and n == w.data.nbytes and w.data.flags.writeable:
        out = w.data.reshape(-1)                                              # (n,) w's bytes
    else:
        out = np.empty(n, np.uint8)                                           # (n,)
    _check(k.fl_pack(w.code, ffi.from_buffer(w.data), w.rows, w.cols, ffi.from_buffer(out)),
           "pack")
    return PackedTensor(out, w.dtype, w.rows, w.cols)


def unpacks(dtype: str, rows: int, cols: int) -> bool:
    """Whether pack() repacks a (rows, cols) `dtype` matrix in a layout unpack_rows undoes
    (q8_0, q5_0, q4_0, q4_k, q6_k in this build)."""
    return _native().fl_unpack_rows(ffi.NULL, dtype_code(dtype), rows, cols, ffi.NULL, 0,
                                    ffi.NULL) == 0


def unpack_rows(p: PackedTensor, ids) -> QTensor:
    """Rows ids (n,) of the packed p as they were before pack(): a (n, cols) QTensor of p's dtype
    (fl_unpack_rows; a tied head's embedding rows). KernelError when p's layout does not unpack."""
    k = _native()
    idx = _ids(ids, "ids", p.rows)                                              # (n,)
    out = np.empty((idx.size, k.fl_row_bytes(p.code, p.cols)), np.uint8)        # (n, row bytes)
    _check(k.fl_unpack_rows(ffi.from_buffer(p.data), p.code, p.rows, p.cols,
                            ffi.from_buffer("int32_t[]", idx), idx.size, ffi.from_buffer(out)),
           "unpack_rows")
    return QTensor(out, p.dtype, idx.size, p.cols)


def matmul(w: QTensor | PackedTensor, x, bias=None, n_threads: int = 1,
           exact: bool = False) -> np.ndarray:
    """y (T, rows) = x (T, cols) @ w^T [+ bias (rows)]; a 1-D x gives a 1-D y.

    Quantized weights meet x quantized to int8 per block of 32 (per 256 for the k-quants, as
    llama.cpp does; each value moves by at most its block's amax / 254) unless exact, which keeps
    x in f32 (a PackedTensor has no exact path)."""
    k = _native()
    xa = _as_f32(x, "x", np.ndim(x))
    x2 = xa.reshape(1, -1) if xa.ndim == 1 else xa  # (T, cols)
    if x2.ndim != 2 or x2.shape[1] != w.cols or x2.shape[0] < 1:
        raise KernelError(f"x must be (T, {w.cols}) for a {w.rows}x{w.cols} weight, "
                          f"got {xa.shape}")
    b = None if bias is None else _as_f32(bias, "bias", 1)  # (rows,)
    if b is not None and b.shape != (w.rows,):
        raise KernelError(f"bias must have shape ({w.rows},), got {b.shape}")
    y = np.empty((x2.shape[0], w.rows), np.float32)  # (T, rows)
    if isinstance(w, PackedTensor):
        if exact:
            raise KernelError("a packed weight has no exact (f32) matmul")
        _check(k.fl_matmul_packed(ffi.from_buffer(w.data), w.code, w.rows, w.cols,
                                  ffi.NULL if b is None else _fptr(b), _fptr(x2), x2.shape[0],
                                  _fptr(y), _threads(n_threads)), "matmul_packed")
        return y[0] if xa.ndim == 1 else y
    _check(k.fl_matmul(ffi.from_buffer(w.data), w.code, w.rows, w.cols,
                       ffi.NULL if b is None else _fptr(b), _fptr(x2), x2.shape[0], _fptr(y),
                       int(exact), _threads(n_threads)), "matmul")
    return y[0] if xa.ndim == 1 else y


def rmsnorm(x, w, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """y (T, n) = x / rms(x) * w per row; out may be x itself."""
    k = _native()
    xa = _as_f32(x, "x", 2)  # (T, n)
    wa = _as_f32(w, "w", 1)  # (n,)
    if wa.shape != (xa.shape[1],):
        raise KernelError(f"norm weight must have shape ({xa.shape[1]},), got {wa.shape}")
    y = np.empty_like(xa) if out is None else _out_f32(out, "out", xa.shape)  # (T, n)
    _check(k.fl_rmsnorm(_fptr(xa), _fptr(wa), _fptr(y), xa.shape[0], xa.shape[1], eps),
           "rmsnorm")
    return y


def layernorm(x, w, b, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """y (T, n) = (x - mean) / sqrt(var + eps) * w + b per row (b may be None)."""
    k = _native()
    xa = _as_f32(x, "x", 2)  # (T, n)
    wa = _as_f32(w, "w", 1)  # (n,)
    ba = None if b is None else _as_f32(b, "b", 1)  # (n,)
    for name, v in (("norm weight", wa), ("norm bias", ba)):
        if v is not None and v.shape != (xa.shape[1],):
            raise KernelError(f"{name} must have shape ({xa.shape[1]},), got {v.shape}")
    y = np.empty_like(xa) if out is None else _out_f32(out, "out", xa.shape)  # (T, n)
    _check(k.fl_layernorm(_fptr(xa), _fptr(wa), ffi.NULL if ba is None else _fptr(ba), _fptr(y),
                          xa.shape[0], xa.shape[1], eps), "layernorm")
    return y


class RopeFreqs:
    """RoPE frequencies checked once: inv_freq (n_rot/2,) positive and finite, as float64 for
    the kernel (a forward pass ropes q and k of every layer with the same few tables)."""

    def __init__(self, inv_freq):
        f = np.array(inv_freq, dtype=np.float64).reshape(-1)             # (n_rot/2,) a copy
        if not f.size or not (np.isfinite(f).all() and (f > 0).all()):
            raise KernelError(f"rope: inv_freq must hold positive finite values, got {f.size}")
        f.flags.writeable = False
        self.freqs = f
        self.ptr = ffi.from_buffer("double[]", f)


def rope(x: np.ndarray, pos, inv_freq) -> np.ndarray:
    """Rotate-half RoPE in place on x (T, n_heads, head_dim) at positions pos (T), pair j turning
    by pos * inv_freq[j] (inv_freq (n_rot/2,), n_rot <= head_dim; model/rope.py makes it; a
    RopeFreqs is not checked again); returns x."""
    k = _native()
    if not isinstance(x, np.ndarray) or x.ndim != 3:
        raise KernelError("rope: x must be a (T, n_heads, head_dim) float32 array")
    _out_f32(x, "rope x", x.shape)
    t, n_heads, head_dim = x.shape
    p = np.ascontiguousarray(pos, dtype=np.int32).reshape(-1)  # (T,)
    if p.shape != (t,):
        raise KernelError(f"rope: pos must have {t} positions, got {p.size}")
    f = inv_freq if isinstance(inv_freq, RopeFreqs) else RopeFreqs(inv_freq)
    if 2 * f.freqs.size > head_dim:
        raise KernelError(f"rope: inv_freq must hold 1..{head_dim // 2} positive finite values, "
                          f"got {f.freqs.size}")
    _check(k.fl_rope(_fptr(x), t, n_heads, head_dim, 2 * f.freqs.size,
                     ffi.from_buffer("int32_t[]", p), f.ptr), "rope")
    return x


def attention(q, k_cache: np.ndarray, v_cache: np.ndarray, pos0: int, scale: float,
              n_threads: int = 1, window: int = 0) -> np.ndarray:
    """Causal GQA attention: q (T, n_heads, head_dim) at positions pos0.. -> (T, n_heads*head_dim);
    window > 0: the query at position p sees the keys of p - window + 1 .. p only.

    k_cache, v_cache (n_ctx, n_kv_heads, head_dim), both float32 or both float16 (C-contiguous,
    never copied), must already hold positions 0 .. pos0+T-1.
    """
    k = _native()
    qa = _as_f32(q, "q", 3)  # (T, n_heads, head_dim)
    t, n_heads, head_dim = qa.shape
    kc, vc = _kv(k_cache, "k_cache"), _kv(v_cache, "v_cache")  # (n_ctx, n_kv_heads, head_dim)
    if kc.ndim != 3 or kc.shape[2] != head_dim or n_heads % kc.shape[1]:
        raise KernelError(f"kv cache must be (n_ctx, n_kv_heads, {head_dim}) with n_kv_heads "
                          f"dividing {n_heads}, got {kc.shape}")
    if vc.shape != kc.shape or vc.dtype != kc.dtype:
        raise KernelError(f"v_cache {vc.dtype} {vc.shape} must match k_cache {kc.dtype} {kc.shape}")
    if pos0 < 0 or pos0 + t > kc.shape[0]:
        raise KernelError(f"positions {pos0}..{pos0 + t - 1} exceed the kv cache "
                          f"of {kc.shape[0]}")
    out = np.empty((t, n_heads * head_dim), np.float32)  # (T, n_heads * head_dim)
    code = k.FL_F32 if kc.dtype == np.float32 else k.FL_F16
    _check(k.fl_attention(_fptr(qa), ffi.from_buffer(kc), ffi.from_buffer(vc), code, _fptr(out),
                          t, pos0, n_heads, kc.shape[1], head_dim, scale, _window(window),
                          _threads(n_threads)),
           "attention")
    return out


def _window(window: int) -> int:
    if int(window) < 0:
        raise KernelError(f"attention window must be >= 0 (0: none), got {window}")
    return int(window)


def _kv(a, name: str) -> np.ndarray:
    """A KV cache: a C-contiguous float32 or float16 numpy array (never copied)."""
    if not isinstance(a, np.ndarray) or a.dtype not in (np.float32, np.float16) or \
            not a.flags.c_contiguous:
        raise KernelError(f"{name} must be a C-contiguous float32 or float16 numpy array")
    return a


def act_mul(act: str, g, u, out: np.ndarray | None = None) -> np.ndarray:
    """h = act(g) * u elementwise (g and u of one shape, f32), or act(u) when g is None: an
    FFN's activations from its gate / up products (fl_act_mul)."""
    k = _native()
    if act not in ACT_CODES:
        raise KernelError(f"unknown activation {act!r}: expected one of {', '.join(ACT_CODES)}")
    ua = np.ascontiguousarray(u, dtype=np.float32)                         # any shape
    ga = None if g is None else np.ascontiguousarray(g, dtype=np.float32)  # u's shape
    if ga is not None and ga.shape != ua.shape:
        raise KernelError(f"act_mul: g {ga.shape} and u {ua.shape} differ")
    h = np.empty_like(ua) if out is None else _out_f32(out, "out", ua.shape)  # u's shape
    _check(k.fl_act_mul(ACT_CODES[act], ffi.NULL if ga is None else _fptr(ga), _fptr(ua),
                        _fptr(h), ua.size), "act_mul")
    return h


def logit_bounds(s: np.ndarray, var: np.ndarray, e: np.ndarray, z: float,
                 slack: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo) (n,) f32 = s +- (z sqrt(e @ var) + slack) for estimates s (n,) f32, error
    variances var (nb, n) f16 and energies e (nb,) (fl_logit_bounds: one pass, no temporaries)."""
    k = _native()
    sa = _as_f32(s, "s", 1)                                               # (n,)
    ea = _as_f32(e, "e", 1)                                               # (nb,)
    if var.dtype != np.float16 or var.shape != (len(ea), len(sa)) or not var.flags.c_contiguous:
        raise KernelError(f"logit_bounds: var must be C-contiguous f16 ({len(ea)}, {len(sa)}), "
                          f"got {var.dtype} {var.shape}")
    hi, lo = np.empty_like(sa), np.empty_like(sa)                         # (n,) each
    _check(k.fl_logit_bounds(_fptr(sa), ffi.from_buffer("uint16_t[]", var), _fptr(ea), len(ea),
                             len(sa), z, slack, _fptr(hi), _fptr(lo)), "logit_bounds")
    return hi, lo


def ffn_block() -> int:
    """Bundle rows one partial sum of ffn_bundles covers (flashllm.h FL_FFN_BLOCK): calls that cut
    a layer's rows at multiples of it give the bits of one call over them all."""
    return int(_native().FL_FFN_BLOCK)


def _check_parts(n: int, stride: int, dtype: str, down_dtype: str, d: int, glu: bool,
                 down: np.ndarray | None) -> None:
    """Bundles of `stride` bytes hold the gate / up rows and, without `down`, the down column."""
    rows, col = (2 if glu else 1) * row_bytes(dtype, d), row_bytes(down_dtype, d)
    if down is None:
        if stride < rows + col:
            raise KernelError(f"bundle stride {stride} is below the {dtype} bundle of {d} "
                              f"values ({rows + col} bytes)")
        return
    if not isinstance(down, np.ndarray) or down.dtype != np.uint8 or down.ndim != 2 \
            or not down.flags.c_contiguous or len(down) != n:
        raise KernelError(f"down must be a C-contiguous ({n}, stride) uint8 array")
    if stride < rows or down.shape[1] < col:
        raise KernelError(f"strides {stride} / {down.shape[1]} are below the {dtype} rows "
                          f"({rows} bytes) / the {down_dtype} column ({col})")


def ffn_bundles(bundles: np.ndarray, dtype: str, d: int, glu: bool, act: str, x, y: np.ndarray,
                ids=None, up_bias=None, n_threads: int = 1, rows=None,
                threshold: float = 0.0, exact: bool = False,
                down_dtype: str | None = None, down: np.ndarray | None = None) -> np.ndarray:
    """y (T, d) += the FFN over bundles (n, stride) [gate | up | down] (see flashllm.h), or
    [gate | up] with the down columns apart in down (n, down stride) (the same bits).

    rows (m,) picks the bundle rows to use (default: all); a term whose |activation| is below
    threshold is dropped (magnitude sparsity). Quantized bundles take gate and up dot products
    on int8-quantized x as matmul does, unless exact. dtype is the gate / up rows', down_dtype
    the down column's (default companion(dtype): dtype, q4_1 for q4_k).

    act: "silu", "relu", "gelu" (the exact erf GELU, Hugging Face "gelu") or "gelu_tanh" (the
    tanh approximation, Hugging Face "gelu_pytorch_tanh" / "gelu_new": Gemma's GeGLU).
    """
    k = _native()
    if act not in ACT_CODES:
        raise KernelError(f"unknown activation {act!r}: expected one of {', '.join(ACT_CODES)}")
    if not isinstance(bundles, np.ndarray) or bundles.dtype != np.uint8 or bundles.ndim != 2 \
            or not bundles.flags.c_contiguous:
        raise KernelError("bundles must be a C-contiguous (n, stride) uint8 array")
    n, stride = bundles.shape
    down_dtype = companion(dtype) if down_dtype is None else down_dtype
    _check_parts(n, stride, dtype, down_dtype, d, glu, down)
    xa = _as_f32(x, "x", 2)  # (T, d)
    if xa.shape[1] != d:
        raise KernelError(f"x must be (T, {d}), got {xa.shape}")
    _out_f32(y, "y", xa.shape)
    ba = None if up_bias is None else _as_f32(up_bias, "up_bias", 1)  # (n_ff,)
    idx = None if ids is None else _ids(ids, "ids", ba.size if ba is not None else 2**31 - 1)
    if idx is not None and idx.shape != (n,):
        raise KernelError(f"ids must have one id per bundle ({n}), got {idx.size}")
    if ba is not None and idx is None and ba.size < n:
        raise KernelError(f"up_bias has {ba.size} values for {n} bundles")
    sel = None if rows is None else _ids(rows, "rows", n)              # (m,) int32
    if not threshold >= 0.0:
        raise KernelError(f"threshold must be >= 0, got {threshold}")
    layer = ffi.new("fl_ffn_layer *", {
        "bundles": ffi.from_buffer(bundles), "n": n, "stride": stride, "dtype": dtype_code(dtype),
        "down_dtype": dtype_code(down_dtype), "d": d, "glu": int(glu), "act": ACT_CODES[act],
        "ids": ffi.NULL if idx is None else ffi.from_buffer("int32_t[]", idx),
        "up_bias": ffi.NULL if ba is None else _fptr(ba),
        "down": ffi.NULL if down is None else ffi.from_buffer(down),
        "down_stride": 0 if down is None else down.shape[1]})
    _check(k.fl_ffn_bundles(layer, ffi.NULL if sel is None else ffi.from_buffer("int32_t[]", sel),
                            0 if sel is None else sel.size, float(threshold),
                            _fptr(xa), xa.shape[0], _fptr(y), int(exact), _threads(n_threads)),
           "ffn_bundles")
    return y
