"""One decode token through a transformer block in one C call each for its attention and its
dense FFN (native/block.c: fl_attn_token, fl_ffn_token).

Each object checks its weights and vectors once and keeps the C struct that points into them
(and the arrays, so the pointers stay valid); a call passes only the token's hidden state. The C
side runs the steps runtime/model.py runs for one token, through the same kernels, so the same
bits; model.py decides which layers qualify (runtime/model.py `_token_blocks`).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from flashllm.errors import KernelError
from flashllm.ffi.kernel import ACT_CODES, RopeFreqs
from flashllm.ffi.lib import check as _check, ffi, native as _native
from flashllm.model.tensor import PackedTensor, QTensor


class CStruct:
    """A cffi struct and the buffers its pointers point into."""

    def __init__(self, ctype: str, n: Optional[int] = None):
        self.c = ffi.new(ctype) if n is None else ffi.new(ctype, n)   # n: an array's length
        self._alive: list = []

    def ptr(self, a: Optional[np.ndarray], ctype: str = "float[]"):
        """A pointer to a (kept alive), or NULL for None."""
        if a is None:
            return ffi.NULL
        p = ffi.from_buffer(ctype, a)
        self._alive += [a, p]
        return p

    def vec(self, a: Optional[np.ndarray], n: int, name: str):
        """A pointer to a float32 vector of n values (checked), or NULL for None."""
        if a is None:
            return ffi.NULL
        if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != (n,) or \
                not a.flags.c_contiguous:
            raise KernelError(f"{name} must be a contiguous float32 ({n},) array")
        return self.ptr(a)

    def mat(self, field, w, bias: Optional[np.ndarray], name: str) -> None:
        """field (an fl_mat) = w with its bias."""
        if not isinstance(w, (QTensor, PackedTensor)):
            raise KernelError(f"{name} must be a QTensor or PackedTensor")
        field.w = self.ptr(w.data, "uint8_t[]")
        field.dtype, field.packed = w.code, int(isinstance(w, PackedTensor))
        field.rows, field.cols = w.rows, w.cols
        field.bias = self.vec(bias, w.rows, name + " bias")


def token_row(x: np.ndarray, d: int):
    """x, a writable contiguous float32 (1, d) row (checked), as a C pointer."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.shape != (1, d) or \
            not x.flags.c_contiguous or not x.flags.writeable:
        raise KernelError(f"x must be a writable contiguous float32 (1, {d}) array")
    return ffi.from_buffer("float[]", x)


class AttnToken(CStruct):
    """A block's attention for one token (fl_attn_token): x (1, d) += it, in place."""

    def __init__(self, norm, qkv, bqkv, o, bo, k_cache: np.ndarray, v_cache: np.ndarray,
                 n_heads: int, head_dim: int, eps: float, scale: float,
                 rope: Optional[RopeFreqs] = None, window: int = 0, q_norm=None, k_norm=None,
                 post_norm=None, qk_norm_full: bool = False):
        """qkv (n_heads hd + 2 n_kv hd, d) and o (d, n_heads hd) matrices (qkv may be the three
        matrices q, k, v as a tuple, bqkv then their three biases or None); k_cache, v_cache the
        layer's (n_ctx, n_kv, hd) f32 or f16 caches; norms as the forward pass holds them (q_norm
        and k_norm (hd,), or (n_heads hd,) and (n_kv hd,) when qk_norm_full: OLMoE)."""
        super().__init__("fl_attn_block *")
        b, d = self.c, o.rows
        if k_cache.dtype not in (np.float32, np.float16) or v_cache.dtype != k_cache.dtype or \
                k_cache.shape != v_cache.shape or k_cache.ndim != 3 or \
                not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
            raise KernelError("the KV caches must be contiguous (n_ctx, n_kv, hd) f32 or f16")
        b.norm = self.vec(norm, d, "norm")
        if isinstance(qkv, tuple):                    # q, k, v of different dtypes: 3 products
            biases = bqkv or (None, None, None)
            for field, w, bias, name in zip((b.qkv, b.k, b.v), qkv, biases, "qkv"):
                self.mat(field, w, bias, name)
        else:
            self.mat(b.qkv, qkv, bqkv, "qkv")
        self.mat(b.o, o, bo, "o")
        n_kv = k_cache.shape[1]
        nq, nk = (n_heads * head_dim, n_kv * head_dim) if qk_norm_full else (head_dim, head_dim)
        b.q_norm, b.k_norm = self.vec(q_norm, nq, "q_norm"), self.vec(k_norm, nk, "k_norm")
        b.qk_norm_full = int(qk_norm_full)
        b.post_norm = self.vec(post_norm, d, "post_norm")
        self._alive.append(rope)
        b.inv_freq = ffi.NULL if rope is None else rope.ptr
        b.n_rot = 0 if rope is None else 2 * rope.freqs.size
        b.k_cache, b.v_cache = self.ptr(k_cache, "uint8_t[]"), self.ptr(v_cache, "uint8_t[]")
        b.kv_dtype = _native().FL_F32 if k_cache.dtype == np.float32 else _native().FL_F16
        b.n_ctx, b.n_kv, b.head_dim = k_cache.shape
        b.n_heads, b.window, b.eps, b.scale = n_heads, window, eps, scale
        self.d = d

    def __call__(self, x: np.ndarray, pos: int, n_threads: int) -> None:
        _check(_native().fl_attn_token(self.c, token_row(x, self.d), self.d, int(pos),
                                       int(n_threads)), "attn_token")


class FfnToken(CStruct):
    """A dense FFN of matrix rows for one token (fl_ffn_token): x (1, d) += it, in place."""

    def __init__(self, norm, gate_up, down, act: str, glu: bool, eps: float, up_bias=None,
                 post_norm=None, down_bias=None):
        """gate_up (2 n_ff or n_ff, d): gate rows then up rows; down (d, n_ff)."""
        super().__init__("fl_ffn_block *")
        if act not in ACT_CODES:
            raise KernelError(f"unknown activation {act!r}: expected one of {', '.join(ACT_CODES)}")
        b, d, n_ff = self.c, down.rows, down.cols
        b.norm = self.vec(norm, d, "norm")
        self.mat(b.gate_up, gate_up, None, "gate_up")
        self.mat(b.down, down, None, "down")
        b.up_bias = self.vec(up_bias, n_ff, "up_bias")
        b.post_norm = self.vec(post_norm, d, "post_norm")
        b.down_bias = self.vec(down_bias, d, "down_bias")
        b.n_ff, b.glu, b.act, b.eps = n_ff, int(glu), ACT_CODES[act], eps
        self.d = d

    def __call__(self, x: np.ndarray, n_threads: int) -> None:
        _check(_native().fl_ffn_token(self.c, token_row(x, self.d), self.d, int(n_threads)),
               "ffn_token")
