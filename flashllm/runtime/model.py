"""The forward pass, top to bottom, over a converted flash model.

One code path serves prefill (T tokens at once) and decode (T = 1):

    x = embed(tokens) [* embed_scale] [+ learned positions] [@ proj_in]
    for each layer:
        x += [norm](attn_output(attention(rope(q), rope(k) → KV cache, v))) [* residual_scale]
             of norm(x) (q, k [QK-normed] per head; the layer's RoPE frequencies and window)
        x += [norm](ffn_bundles(norm(x))) [* residual_scale] [+ down bias]
             ([norm]: sandwich-norm models)
    logits = [softcap](output([proj_out](norm(x)) [/ logit_scale]))

Per-token math runs in C through flashllm/ffi/kernel.py; numpy only reshapes and adds. The FFN of each layer
is a strategy object (an FfnStrategy, flashllm/runtime/interfaces.py): `ffn(layer, h, x)` adds
the FFN of h to x. The default,
DenseFfn, reads every layer's bundles into DRAM; the sparse flash FFN streams them. The other
weights come from a DenseSource: a DenseWeights (flashllm/runtime/weights.py), resident or
streamed from dense.bin where the DRAM budget cannot hold them.

A one-token pass runs a layer's attention and its dense FFN as one C call each where they
qualify (_token_blocks: ffi/block.py, native/block.c): the same kernel calls in the same order
as _attention_block and _ffn_block, so the same bits, without Python between them.
"""
from __future__ import annotations

import copy
from typing import Callable, Optional, Sequence

import numpy as np

from flashllm.ffi import kernel
from flashllm.ffi.block import AttnToken, FfnToken
from flashllm.ffi.moe import MoeToken
from flashllm.format.reader import FlashModel
from flashllm.model.rope import inv_freq
from flashllm.runtime.interfaces import DenseSource, FfnStrategy
from flashllm.runtime.layer import Layer
from flashllm.runtime.sparse_head import SparseHead
from flashllm.runtime.weights import DenseWeights
from flashllm.errors import FlashError
from flashllm.runtime.ffn import DenseFfn
from flashllm.runtime.moe import MoeFfn


class ContextError(FlashError):
    """A forward pass that would run past the KV cache (n_ctx) or got no tokens."""


KV_DTYPES = {"f32": np.float32, "f16": np.float16}   # the KV cache's element type
ROW_TILE = 10         # rows a product gives each its one-token sums (FL_SMALL_T, native/qgemm.h:
                      # more meet the int8 GEMM panels, which sum in another order)


class Model:
    """A flash model made runnable: dense weights, an FFN strategy, a preallocated KV cache."""

    def __init__(self, flash: FlashModel, n_threads: int = 1, n_ctx: int = 2048,
                 ffn: Optional[FfnStrategy] = None, weights: Optional[DenseSource] = None,
                 exact: bool = False, kv_dtype: str = "f32", head: Optional[SparseHead] = None):
        cfg = flash.config
        if n_ctx <= 0:
            raise ContextError(f"n_ctx={n_ctx} must be positive")
        self.config = cfg
        self.n_threads = n_threads
        n_ctx = min(n_ctx, cfg.max_positions or n_ctx)   # learned positions end at the table's
        self.n_ctx = n_ctx
        self.exact = exact      # q4_0 / q4_1 / q8_0 matmuls in f32 instead of on int8 activations
        if ffn is None:
            ffn = (MoeFfn if cfg.n_experts else DenseFfn)(flash, n_threads, exact=exact)
        self.ffn: FfnStrategy = ffn
        self.w: DenseSource = DenseWeights(flash, n_threads, pack=not exact) if weights is None else weights
        self.head = head        # the sparse output head (runtime/sparse_head.py) or None: the whole head
        self.fed = np.zeros(n_ctx, dtype=np.int32)                       # (n_ctx,) token at each position
        shape = (cfg.n_layers, n_ctx, cfg.n_kv_heads, cfg.head_dim)
        if kv_dtype not in KV_DTYPES:
            raise ContextError(f"kv_dtype {kv_dtype!r}: expected one of {', '.join(KV_DTYPES)}")
        kv = KV_DTYPES[kv_dtype]      # `run` keeps f16 keys/values, as llama.cpp does
        self.k_cache = np.zeros(shape, dtype=kv)                         # (n_layers, n_ctx, n_kv, hd)
        self.v_cache = np.zeros(shape, dtype=kv)                         # (n_layers, n_ctx, n_kv, hd)
        sliding = set(cfg.sliding_layers)
        self.windows = [cfg.sliding_window if i in sliding else 0 for i in range(cfg.n_layers)]
        glob = inv_freq(cfg.rope_theta, cfg.head_dim, cfg.rope_freq_factors)  # (hd/2,)
        local = inv_freq(cfg.rope_local_theta, cfg.head_dim) if cfg.rope_local_theta else glob
        glob, local = kernel.RopeFreqs(glob), kernel.RopeFreqs(local)     # checked once
        self.rope_inv = [local if i in sliding else glob for i in range(cfg.n_layers)]  # (hd/2,) each
        self.attn_scale = cfg.attn_scale or cfg.head_dim ** -0.5
        self.token_blocks = True      # one-token passes run qualifying layers in C (False:
                                      # the kernel-call sequence, as tests and benches compare)
        self._blocks = None           # _token_blocks: built on the first one-token pass

    def sibling(self, ffn: FfnStrategy, weights: DenseSource) -> "Model":
        """A model over the same config and KV cache with another FFN and dense weights (the
        resident sub-network, runtime/resident.py): what either writes, the other reads."""
        other = copy.copy(self)
        other.ffn, other.w, other.head = ffn, weights, None
        other._blocks = None          # its own, from its FFN and weights
        return other

    def new_stream(self) -> "Model":
        """Another network over this one's FFN, dense weights and head, with its own empty KV
        cache of n_ctx positions (a server's next stream: runtime/batch.py passes them
        together). Its cache's pages are not touched until written."""
        other = copy.copy(self)
        other.fed = np.zeros(self.fed.shape, self.fed.dtype)             # (n_ctx,)
        other.k_cache = np.zeros(self.k_cache.shape, self.k_cache.dtype)  # (n_layers, n_ctx, n_kv, hd)
        other.v_cache = np.zeros(self.v_cache.shape, self.v_cache.dtype)  # (n_layers, n_ctx, n_kv, hd)
        other._blocks = None          # its own, over its own cache
        return other

    def reset(self) -> None:
        """Forget the context: clear the KV cache."""
        self.k_cache.fill(0.0)
        self.v_cache.fill(0.0)

    def forward(self, tokens, pos0: int, last_only: bool = False,
                siblings: Sequence[int] = (),
                progress: Optional[Callable[[int, int], None]] = None,
                allowed: Optional[list] = None) -> np.ndarray:
        """logits (T, vocab) f32 for tokens (T,) at positions pos0 .. pos0+T-1; (1, vocab) for
        the last position only when last_only (a prompt's prefill: the FFN's stats count the pass
        as prefill, any other as decode). Keys/values of those positions enter the cache.

        siblings (S,): the last S tokens are alternatives, not a continuation: token T - S + s
        stands at position pos0 + siblings[s] (1 <= siblings[s] < T - S) in place of the chain's
        token there, after the chain's tokens before it. Its logits are the ones a pass with it
        in the chain would give, bit for bit (each query attends to exactly those keys, in the
        same order); its keys and values stay aside until keep_sibling puts them in the cache.
        progress(layers done, n_layers) after each layer (a long prompt's prefill shows it).
        allowed: a grammar's (vocab,) bool mask of each returned row (None: any token): the
        sparse head reads only allowed rows, a logit it does not read is -inf."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)  # (T,)
        sib = np.asarray(siblings, dtype=np.int32).reshape(-1)           # (S,)
        T, n = len(tokens), len(tokens) - len(sib)
        if n <= 0 or pos0 < 0 or pos0 + n > self.n_ctx:
            limit = "the model's learned positions" if self.n_ctx == self.config.max_positions \
                else "raise --ctx-size"
            raise ContextError(f"cannot run {n} tokens at position {pos0}: the context holds "
                               f"{self.n_ctx} ({limit})")
        if len(sib) and (last_only or sib.min() < 1 or sib.max() >= n):
            raise ContextError(f"siblings {sib.tolist()} must stand at chain positions 1..{n - 1}")
        pos = np.concatenate([np.arange(pos0, pos0 + n, dtype=np.int32), pos0 + sib])  # (T,)
        self.feed(tokens, pos0, n)
        self.ffn.start_pass(T, prefill=last_only, pos0=pos0)
        if allowed is not None and self.head is not None:
            self.head.prepare(allowed)      # a grammar's few rows: the sketch's reads skipped
        x = self._embed(tokens, pos)                                     # (T, d_model)
        blocks = self._token_blocks() if T == 1 and self.token_blocks else None
        for i in range(self.config.n_layers):
            attn, ffn = blocks[i] if blocks else (None, None)
            layer = None if attn and ffn else self.w.layer(i)          # streamed: read now
            if attn:
                attn(x, pos0, self.n_threads)                            # x (1, d_model) += attn
            else:
                self._attention_block(i, layer, x, pos, n)               # x (T, d_model) += attn
            if ffn:
                ffn(x, self.n_threads)                                   # x (1, d_model) += ffn
            else:
                self._ffn_block(i, layer, x)                             # x (T, d_model) += ffn
            if progress is not None:
                progress(i + 1, self.config.n_layers)
        if last_only:
            x = np.ascontiguousarray(x[-1:])                             # (1, d_model)
        return self.output_rows(x, pos[-len(x):], tokens[-len(x):], allowed)  # (T, vocab)

    def output_rows(self, x: np.ndarray, pos: np.ndarray, tokens: np.ndarray,
                    allowed: Optional[list] = None) -> np.ndarray:
        """logits (T, vocab) of the last layer's rows x (T, d_model), at positions pos (T,)
        fed tokens (T,): the final norm, the output head and the soft cap. allowed: forward's."""
        x = self._norm(x, self.w.out_norm, self.w.out_norm_b)            # (T, d_model)
        if self.w.proj_out is not None:
            x = kernel.matmul(self.w.proj_out, x, None, self.n_threads, self.exact)  # (T, d_embed)
        if self.config.logit_scale != 1.0:       # head(x) / s as head(x / s): the sparse head too
            x = x / np.float32(self.config.logit_scale)                  # (T, embed_dim)
        logits = self._output(x, pos, tokens, allowed)                   # (T, vocab)
        cap = self.config.final_softcap
        if not cap:
            return logits
        capped = np.tanh(logits / np.float32(cap)) * np.float32(cap)     # (T, vocab)
        return capped if self.head is None else np.where(np.isneginf(logits), logits, capped)

    # ---- the pieces a pass over several streams runs (runtime/batch.py) ----------------------

    def embed_rows(self, tokens: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """The first layer's rows (T, d_model) of tokens (T,) at positions pos (T,)."""
        return self._embed(tokens, pos)

    def attention_rows(self, i: int, layer: Layer, x: np.ndarray, pos: np.ndarray,
                       spans: Sequence[tuple]) -> None:
        """x (T, d_model) += layer i's attention of x, whose rows a .. e-1 are net's at
        positions pos[a:e] for each (net, a, e[, n]) of spans (networks over this one's weights:
        runtime/batch.py): its chain, the first n of them (all when n is not given), then its
        siblings (forward). The norm and the q / k / v and output products run over all rows
        at once, ROW_TILE rows a call (a streamed layer read once for every stream, a resident
        one's weights streamed from DRAM once); the attention on each net's KV cache."""
        cfg, nt, ex = self.config, self.n_threads, self.exact
        h = self._norm(x, layer.attn_norm, layer.attn_norm_b)            # (T, d_model)
        tiles = [slice(a, a + ROW_TILE) for a in range(0, len(h), ROW_TILE)]
        parts = [self.qkv_rows(i, layer, h[t], pos[t]) for t in tiles]   # [(q, k, v)] a tile
        q, k, v = (np.concatenate(p) for p in zip(*parts))   # (T, n_heads, hd), (T, n_kv, hd) x 2
        o = np.empty((len(h), cfg.n_heads * cfg.head_dim), np.float32)  # (T, n_heads * hd)
        for span in spans:
            net, a, e = span[:3]
            n = span[3] if len(span) > 3 else e - a
            o[a:e] = net.attend(i, q[a:e], k[a:e], v[a:e], pos[a:e], n)
        a = np.concatenate([kernel.matmul(layer.wo, o[t], layer.bo, nt, ex)
                            for t in tiles])                              # (T, d_model)
        if layer.post_attn_norm is not None:                             # sandwich norm
            a = self._norm(a, layer.post_attn_norm, None)                # (T, d_model)
        self._residual(x, a)

    def ffn_rows(self, i: int, layer: Layer, x: np.ndarray) -> None:
        """x (T, d_model) += layer i's FFN of x (rows of any streams: the FFN is shared)."""
        self._ffn_block(i, layer, x)

    def _attention_block(self, i: int, layer: Layer, x: np.ndarray, pos: np.ndarray,
                         n: int) -> None:
        """x (T, d_model) += layer i's attention of x (forward's pos and n)."""
        h = self._norm(x, layer.attn_norm, layer.attn_norm_b)            # (T, d_model)
        a = self._attention(i, layer, h, pos, n)                         # (T, d_model)
        if layer.post_attn_norm is not None:                             # sandwich norm
            a = self._norm(a, layer.post_attn_norm, None)                # (T, d_model)
        self._residual(x, a)

    def _ffn_block(self, i: int, layer: Layer, x: np.ndarray) -> None:
        """x (T, d_model) += layer i's FFN of x, through the FFN strategy."""
        h = self._norm(x, layer.ffn_norm, layer.ffn_norm_b)              # (T, d_model)
        if layer.post_ffn_norm is None and self.config.residual_scale == 1.0:
            self.ffn(i, h, x)                                            # x (T, d_model) += ffn(h)
        else:
            f = np.zeros_like(x)                                         # (T, d_model)
            self.ffn(i, h, f)
            if layer.post_ffn_norm is not None:
                f = self._norm(f, layer.post_ffn_norm, None)             # (T, d_model)
            self._residual(x, f)
        if layer.down_b is not None:
            x += layer.down_b

    def _residual(self, x: np.ndarray, a: np.ndarray) -> None:
        """x (T, d_model) += a (T, d_model), times residual_scale (Granite) where it is not 1."""
        r = self.config.residual_scale
        x += a if r == 1.0 else a * np.float32(r)

    def _token_blocks(self) -> list:
        """Per layer (AttnToken or None, FfnToken or None): the sub-blocks a one-token pass runs
        in one C call each (ffi/block.py, the same bits as _attention_block / _ffn_block) —
        an RMSNorm, RoPE model's resident attention (q / k / v fused, runtime/layer.py, or three),
        a DenseFfn of matrix rows, a MoeFfn's packed experts without a shared one (ffi/moe.py:
        norm, router, routing and experts); int8 activations (not exact). Built on first use."""
        if self._blocks is None:
            self._blocks = [self._blocks_of(i) for i in range(self.config.n_layers)]
        return self._blocks

    def _blocks_of(self, i: int) -> tuple:
        cfg, L, f = self.config, self.w.resident_layer(i), self.ffn   # never a streamed layer
        if self.exact or cfg.norm != "rms" or L is None or cfg.residual_scale != 1.0:
            return None, None                    # the C blocks add unscaled outputs
        qkv, bqkv = (L.wqkv, L.bqkv) if L.wqkv is not None else \
            ((L.wq, L.wk, L.wv), (L.bq, L.bk, L.bv))          # q, k, v of different dtypes
        attn = None if cfg.pos != "rope" else AttnToken(
            L.attn_norm, qkv, bqkv, L.wo, L.bo, self.k_cache[i], self.v_cache[i],
            cfg.n_heads, cfg.head_dim, cfg.norm_eps, self.attn_scale, self.rope_inv[i],
            self.windows[i], L.q_norm, L.k_norm, L.post_attn_norm, cfg.qk_norm_full)
        ffn = None if not isinstance(f, DenseFfn) or not f.rows else FfnToken(
            L.ffn_norm, f.gate_up[i], f.down[i], f.act, f.glu, cfg.norm_eps, f.up_b[i],
            L.post_ffn_norm, L.down_b)
        if isinstance(f, MoeFfn) and f.sets is not None and f.routers.shared_gate[i] is None \
                and L.post_ffn_norm is None and L.down_b is None:
            ffn = MoeToken(L.ffn_norm, f.routers.weights[i], f.sets[i], f.routers.k,
                           f.routers.norm_topk, cfg.norm_eps)
        return attn, ffn

    def feed(self, tokens: np.ndarray, pos0: int, n: int) -> None:
        """A pass is about to run tokens (T,) whose first n are the chain at pos0 ..: they
        become the context's tokens there; the rest are siblings (forward), whose keys and
        values are set aside."""
        self.fed[pos0:pos0 + n] = tokens[:n]
        self._sibling_kv(tokens[n:])

    def keep_sibling(self, s: int, pos: int) -> None:
        """Sibling s of the last pass becomes the context's token at pos (its position there):
        its keys and values enter the cache."""
        self.k_cache[:, pos] = self._sib_k[:, s]
        self.v_cache[:, pos] = self._sib_v[:, s]
        self.fed[pos] = self._sib_tokens[s]

    def _sibling_kv(self, tokens: np.ndarray) -> None:
        """Room for the keys and values of a pass's sibling tokens (S,)."""
        cfg = self.config
        self._sib_tokens = tokens.copy()                                 # (S,)
        shape = (cfg.n_layers, len(tokens), cfg.n_kv_heads, cfg.head_dim)
        self._sib_k = np.zeros(shape, self.k_cache.dtype)                # (n_layers, S, n_kv, hd)
        self._sib_v = np.zeros(shape, self.v_cache.dtype)                # (n_layers, S, n_kv, hd)

    def _output(self, x: np.ndarray, pos: np.ndarray, tokens: np.ndarray,
                allowed: Optional[list] = None) -> np.ndarray:
        """(T, vocab) logits of x at positions pos (T,) fed tokens (T,): resident or streamed
        head, or the sparse head's (-inf where the sampler cannot keep a token, or a grammar's
        mask in allowed forbids it)."""
        if self.head is None:
            return self.w.output(x, self.exact)                          # (T, vocab)
        n = self.head.need.recent
        recent = [np.append(self.fed[0 if n < 0 else max(0, p + 1 - n):p], t) if n
                  else self.fed[:0] for p, t in zip(pos, tokens)]        # (<= n,) each
        return self.head.logits(x, recent, self.exact, allowed)          # (T, vocab)

    def _embed(self, tokens: np.ndarray, pos: np.ndarray) -> np.ndarray:
        cfg = self.config
        if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
            raise ContextError(f"token id outside the vocabulary [0, {cfg.vocab_size})")
        x = self.w.embed(tokens)                                         # (T, embed_dim)
        if cfg.embed_scale != 1.0:
            x *= np.float32(cfg.embed_scale)                             # Gemma: sqrt(d_model)
        if self.w.proj_in is not None:
            x = kernel.matmul(self.w.proj_in, x, None, self.n_threads, self.exact)  # (T, d_model)
        if cfg.pos == "learned":
            x += kernel.get_rows(self.w.pos_embd, pos + cfg.pos_offset)  # (T, d_model)
        return np.ascontiguousarray(x, dtype=np.float32)

    def _norm(self, x: np.ndarray, w: np.ndarray, b: Optional[np.ndarray]) -> np.ndarray:
        if self.config.norm == "rms":
            return kernel.rmsnorm(x, w, self.config.norm_eps)            # (T, d_model)
        return kernel.layernorm(x, w, b, self.config.norm_eps)           # (T, d_model)

    def _attention(self, i: int, L: Layer, h: np.ndarray, pos: np.ndarray, n: int):
        """Layer i's attention of h (T, d_model): the first n tokens a chain from pos[0], the
        rest siblings (forward)."""
        q, k, v = self.qkv_rows(i, L, h, pos)              # (T, n_heads, hd), (T, n_kv, hd) x 2
        o = self.attend(i, q, k, v, pos, n)                               # (T, n_heads * hd)
        return kernel.matmul(L.wo, o, L.bo, self.n_threads, self.exact)   # (T, d_model)

    def qkv_rows(self, i: int, L: Layer, h: np.ndarray, pos: np.ndarray) -> tuple:
        """Layer i's q (T, n_heads, hd), k and v (T, n_kv, hd) of h (T, d_model) at positions
        pos (T,): projected, QK-normed, rotated. Each row's numbers are its own (any rows of
        any streams may share the call, up to ROW_TILE of them: runtime/batch.py)."""
        cfg, T, hd = self.config, len(h), self.config.head_dim
        q, k, v = self._qkv(L, h)                          # (T, n_heads * hd), (T, n_kv * hd) x 2
        if cfg.qk_norm_full:                                              # QK-norm, whole q / k
            q = kernel.rmsnorm(q, L.q_norm, cfg.norm_eps)                 # (T, n_heads * hd)
            k = kernel.rmsnorm(k, L.k_norm, cfg.norm_eps)                 # (T, n_kv * hd)
        q, k = q.reshape(T, cfg.n_heads, hd), k.reshape(T, cfg.n_kv_heads, hd)
        v = v.reshape(T, cfg.n_kv_heads, hd)                              # (T, n_kv, hd)
        if L.q_norm is not None and not cfg.qk_norm_full:                 # QK-norm, per head
            q = self._head_norm(q, L.q_norm)                              # (T, n_heads, hd)
            k = self._head_norm(k, L.k_norm)                              # (T, n_kv, hd)
        if cfg.pos == "rope":
            kernel.rope(q, pos, self.rope_inv[i])
            kernel.rope(k, pos, self.rope_inv[i])
        return q, k, v

    def attend(self, i: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray,
               n: int) -> np.ndarray:
        """(T, n_heads * hd): layer i's attention of q (T, n_heads, hd) over this model's KV
        cache, whose positions pos[:n] (a chain from pos[0]) take k, v (T, n_kv, hd) first; the
        rest are siblings (forward)."""
        cfg, nt, T = self.config, self.n_threads, len(q)
        pos0 = int(pos[0])
        self.k_cache[i, pos0:pos0 + n] = k[:n]
        self.v_cache[i, pos0:pos0 + n] = v[:n]
        o = np.empty((T, cfg.n_heads * cfg.head_dim), np.float32)        # (T, n_heads * hd)
        o[:n] = kernel.attention(q[:n], self.k_cache[i], self.v_cache[i], pos0, self.attn_scale,
                                 n_threads=nt, window=self.windows[i])
        for s in range(n, T):       # a sibling: its keys in its position's slot for one query
            p, kc, vc = int(pos[s]), self.k_cache[i], self.v_cache[i]
            chain_k, chain_v = kc[p].copy(), vc[p].copy()                 # (n_kv, hd) each
            kc[p], vc[p] = k[s], v[s]
            self._sib_k[i, s - n], self._sib_v[i, s - n] = kc[p], vc[p]
            o[s] = kernel.attention(q[s:s + 1], kc, vc, p, self.attn_scale, n_threads=nt,
                                    window=self.windows[i])[0]
            kc[p], vc[p] = chain_k, chain_v
        return o

    def _qkv(self, L: Layer, h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q (T, n_heads * hd), k and v (T, n_kv * hd) of h (T, d_model), each C-contiguous:
        one product where the layer's q, k and v are one matrix (runtime/layer.py)."""
        nt, ex = self.n_threads, self.exact
        if L.wqkv is None:
            return tuple(kernel.matmul(w, h, b, nt, ex)
                         for w, b in ((L.wq, L.bq), (L.wk, L.bk), (L.wv, L.bv)))
        cfg = self.config
        qkv = kernel.matmul(L.wqkv, h, L.bqkv, nt, ex)                  # (T, nq + 2 nkv)
        nq, nk = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        return tuple(np.ascontiguousarray(qkv[:, a:b])                   # views when T = 1
                     for a, b in ((0, nq), (nq, nq + nk), (nq + nk, nq + 2 * nk)))

    def _head_norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """RMSNorm of each head's vector: x (T, heads, hd) -> (T, heads, hd)."""
        T, heads, hd = x.shape
        return kernel.rmsnorm(x.reshape(T * heads, hd), w, self.config.norm_eps).reshape(T, heads, hd)
