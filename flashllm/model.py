"""The forward pass, top to bottom, over a converted flash model.

One code path serves prefill (T tokens at once) and decode (T = 1):

    x = embed(tokens) [+ learned positions] [@ proj_in]
    for each layer:
        x += attn_output(attention(rope(q), rope(k) → KV cache, v))     of norm(x)
        x += ffn_bundles(norm(x)) [+ down bias]
    logits = output([proj_out](norm(x)))

Per-token math runs in C through kernel.py; numpy only reshapes and adds. The FFN of each layer
is a strategy object (flashllm/ffn.py): `ffn(layer, h, x)` adds the FFN of h to x. The default,
DenseFfn, reads every layer's bundles into DRAM; the sparse flash FFN streams them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import kernel
from .ffn import DenseFfn
from .tensor import QTensor
from .errors import FlashError


class ContextError(FlashError):
    """A forward pass that would run past the KV cache (n_ctx) or got no tokens."""


@dataclass
class Layer:
    """One transformer block's resident weights. Matrices are QTensors, vectors f32 ndarrays."""
    attn_norm: np.ndarray               # (d_model,)
    attn_norm_b: Optional[np.ndarray]   # (d_model,) LayerNorm models only
    wq: QTensor                         # (n_heads * hd, d_model)
    wk: QTensor                         # (n_kv * hd, d_model)
    wv: QTensor                         # (n_kv * hd, d_model)
    wo: QTensor                         # (d_model, n_heads * hd)
    bq: Optional[np.ndarray]            # (n_heads * hd,)
    bk: Optional[np.ndarray]            # (n_kv * hd,)
    bv: Optional[np.ndarray]            # (n_kv * hd,)
    bo: Optional[np.ndarray]            # (d_model,)
    ffn_norm: np.ndarray                # (d_model,)
    ffn_norm_b: Optional[np.ndarray]    # (d_model,)
    down_b: Optional[np.ndarray]        # (d_model,)


def _opt(flash, name: str) -> Optional[np.ndarray]:
    """The tensor `name` if the model has it, else None."""
    return flash.tensor(name) if flash.has(name) else None


def load_layer(flash, i: int) -> Layer:
    """Layer i's resident weights: attention, norms and biases (the FFN belongs to the strategy)."""
    p = f"blk.{i}."
    return Layer(
        attn_norm=flash.tensor(p + "attn_norm.weight"), attn_norm_b=_opt(flash, p + "attn_norm.bias"),
        wq=flash.tensor(p + "attn_q.weight"), wk=flash.tensor(p + "attn_k.weight"),
        wv=flash.tensor(p + "attn_v.weight"), wo=flash.tensor(p + "attn_output.weight"),
        bq=_opt(flash, p + "attn_q.bias"), bk=_opt(flash, p + "attn_k.bias"),
        bv=_opt(flash, p + "attn_v.bias"), bo=_opt(flash, p + "attn_output.bias"),
        ffn_norm=flash.tensor(p + "ffn_norm.weight"), ffn_norm_b=_opt(flash, p + "ffn_norm.bias"),
        down_b=_opt(flash, p + "ffn_down.bias"),
    )


class Model:
    """A flash model made runnable: resident weights, an FFN strategy, a preallocated KV cache."""

    def __init__(self, flash, n_threads: int = 1, n_ctx: int = 2048, ffn=None):
        cfg = flash.config
        if n_ctx <= 0:
            raise ContextError(f"n_ctx={n_ctx} must be positive")
        self.config = cfg
        self.n_threads = n_threads
        self.n_ctx = n_ctx
        self.ffn = DenseFfn(flash, n_threads) if ffn is None else ffn
        self.token_embd = flash.tensor("token_embd.weight")              # QTensor (vocab, embed_dim)
        self.pos_embd = _opt(flash, "position_embd.weight")              # QTensor (n_pos, d_model)
        self.proj_in = _opt(flash, "proj_in.weight")                     # QTensor (d_model, embed_dim)
        self.proj_out = _opt(flash, "proj_out.weight")                   # QTensor (embed_dim, d_model)
        self.out_norm = flash.tensor("output_norm.weight")               # (d_model,)
        self.out_norm_b = _opt(flash, "output_norm.bias")                # (d_model,)
        tied = not flash.has("output.weight")
        self.output = self.token_embd if tied else flash.tensor("output.weight")  # (vocab, embed_dim)
        self.layers = [load_layer(flash, i) for i in range(cfg.n_layers)]
        shape = (cfg.n_layers, n_ctx, cfg.n_kv_heads, cfg.head_dim)
        self.k_cache = np.zeros(shape, dtype=np.float32)                 # (n_layers, n_ctx, n_kv, hd)
        self.v_cache = np.zeros(shape, dtype=np.float32)                 # (n_layers, n_ctx, n_kv, hd)

    def reset(self) -> None:
        """Forget the context: clear the KV cache."""
        self.k_cache.fill(0.0)
        self.v_cache.fill(0.0)

    def forward(self, tokens, pos0: int, last_only: bool = False) -> np.ndarray:
        """logits (T, vocab) f32 for tokens (T,) at positions pos0 .. pos0+T-1; (1, vocab) for
        the last position only when last_only. Keys/values of those positions enter the cache."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)  # (T,)
        T = len(tokens)
        if T == 0 or pos0 < 0 or pos0 + T > self.n_ctx:
            raise ContextError(f"cannot run {T} tokens at position {pos0}: the context holds "
                               f"{self.n_ctx} (raise --ctx-size)")
        pos = np.arange(pos0, pos0 + T, dtype=np.int32)                  # (T,)
        x = self._embed(tokens, pos)                                     # (T, d_model)
        for i, layer in enumerate(self.layers):
            h = self._norm(x, layer.attn_norm, layer.attn_norm_b)        # (T, d_model)
            x += self._attention(i, layer, h, pos, pos0)                 # (T, d_model)
            h = self._norm(x, layer.ffn_norm, layer.ffn_norm_b)          # (T, d_model)
            self.ffn(i, h, x)                                            # x (T, d_model) += ffn(h)
            if layer.down_b is not None:
                x += layer.down_b
        if last_only:
            x = np.ascontiguousarray(x[-1:])                             # (1, d_model)
        x = self._norm(x, self.out_norm, self.out_norm_b)                # (T, d_model)
        if self.proj_out is not None:
            x = kernel.matmul(self.proj_out, x, n_threads=self.n_threads)  # (T, embed_dim)
        return kernel.matmul(self.output, x, n_threads=self.n_threads)   # (T, vocab)

    def _embed(self, tokens: np.ndarray, pos: np.ndarray) -> np.ndarray:
        cfg = self.config
        if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
            raise ContextError(f"token id outside the vocabulary [0, {cfg.vocab_size})")
        x = kernel.get_rows(self.token_embd, tokens)                     # (T, embed_dim)
        if self.proj_in is not None:
            x = kernel.matmul(self.proj_in, x, n_threads=self.n_threads)  # (T, d_model)
        if cfg.pos == "learned":
            x += kernel.get_rows(self.pos_embd, pos + cfg.pos_offset)    # (T, d_model)
        return np.ascontiguousarray(x, dtype=np.float32)

    def _norm(self, x: np.ndarray, w: np.ndarray, b: Optional[np.ndarray]) -> np.ndarray:
        if self.config.norm == "rms":
            return kernel.rmsnorm(x, w, self.config.norm_eps)            # (T, d_model)
        return kernel.layernorm(x, w, b, self.config.norm_eps)           # (T, d_model)

    def _attention(self, i: int, L: Layer, h: np.ndarray, pos: np.ndarray, pos0: int):
        cfg, nt = self.config, self.n_threads
        T, hd = len(h), cfg.head_dim
        q = kernel.matmul(L.wq, h, L.bq, n_threads=nt).reshape(T, cfg.n_heads, hd)     # (T, n_heads, hd)
        k = kernel.matmul(L.wk, h, L.bk, n_threads=nt).reshape(T, cfg.n_kv_heads, hd)  # (T, n_kv, hd)
        v = kernel.matmul(L.wv, h, L.bv, n_threads=nt).reshape(T, cfg.n_kv_heads, hd)  # (T, n_kv, hd)
        if cfg.pos == "rope":
            kernel.rope(q, pos, cfg.rope_theta, hd)
            kernel.rope(k, pos, cfg.rope_theta, hd)
        self.k_cache[i, pos0:pos0 + T] = k
        self.v_cache[i, pos0:pos0 + T] = v
        o = kernel.attention(q, self.k_cache[i], self.v_cache[i], pos0, hd ** -0.5,
                             n_threads=nt)                                # (T, n_heads * hd)
        return kernel.matmul(L.wo, o, L.bo, n_threads=nt)                 # (T, d_model)
