"""The dense model over many chunks of tokens one layer at a time, in memory that does not grow
with the model: what `flashllm calibrate` runs (sparsity/calibrate.py).

A Model runs token-major: every layer's weights resident, one chunk of tokens through all of
them. Calibration runs thousands of tokens, so here the hidden states of all of them (N,
d_model) go through one layer before the next: that layer's attention read from dense.bin and
packed (as a resident model packs it), its FFN read from the flash folder (the rows a DenseFfn
multiplies, or its bundles under thresholds), each chunk of n_ctx tokens from position 0 (the
KV cache holds one layer: the layers take turns in it), then dropped. The embedding rows and
the output head are read from dense.bin as a budgeted run reads them (runtime/weights.py), the
head in row chunks whose logits are reduced to what the caller needs before the next chunk.
The same kernel calls on the same inputs as Model.forward (its _attention_block and
_ffn_block), so the same values: a chunk's tokens, layer by layer.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional, Sequence

import numpy as np

from flashllm.ffi import kernel
from flashllm.ffi.heap import trim_heap
from flashllm.ffi.reader import Reader
from flashllm.model.tensor import QTensor
from flashllm.runtime.ffn import DenseFfn
from flashllm.runtime.layer import attn_names, fuse_qkv, load_layer
from flashllm.runtime.model import Model
from flashllm.runtime.weights import DenseWeights
from flashllm.units import KiB

READ_THREADS, READ_STAGE = 4, 256 * KiB     # the dense.bin reader's (embedding rows, head chunks)

FFN_TOKENS = 128    # tokens an FFN call takes: its (T, 2 n_ff) products stay small (a product
                    # does not depend on how many tokens a call holds: runtime/assemble.make_weights)
OnInput = Callable[[int, np.ndarray], None]  # (layer, FFN inputs h (N, d_model) of all tokens)


class LayerPass:
    """The dense model of flash made to run layer-major over many tokens (module doc)."""

    def __init__(self, flash, n_threads: int = 1, n_ctx: int = 512):
        cfg = flash.config
        self.flash, self.config, self.n_threads = flash, cfg, n_threads
        streamed = {n for i in range(cfg.n_layers) for n in attn_names(i)} | {
            "token_embd.weight", "output.weight"}
        self.reader = Reader(flash.dense_file, n_threads=READ_THREADS, stage_bytes=READ_STAGE)
        self.w = DenseWeights(flash, n_threads, streamed, self.reader, pack=True)
        self.model = Model(flash, n_threads, n_ctx, ffn=DenseFfn(flash, n_threads, layers=[]),
                           weights=self.w)
        self.n_ctx = self.model.n_ctx
        m, one = self.model, np.zeros((self.n_ctx, cfg.n_kv_heads, cfg.head_dim), np.float32)
        view = lambda a: np.lib.stride_tricks.as_strided(       # noqa: E731 (every layer's
            a, (cfg.n_layers, *a.shape), (0, *a.strides))           # cache is this one)
        m.k_cache, m.v_cache = view(one), view(one.copy())      # (n_layers, n_ctx, n_kv, hd)

    def run(self, tokens: Sequence[int], on_input: Optional[OnInput] = None,
            thresholds: Optional[list] = None, on_layer: Callable[[int], None] = lambda i: None,
            n_ctx: Optional[int] = None) -> np.ndarray:
        """The final hidden states (N, d_model), before the output norm, of tokens (N,) run in
        chunks of n_ctx from an empty context each (as sparsity/calibrate.run_chunks does); on_input
        gets each layer's FFN inputs of all tokens before the next layer runs. thresholds: the
        FFN over the bundles with these per-layer thresholds (zeros: none) as a budgeted run
        multiplies them; None: the dense model's own FFN. on_layer(i) after layer i. n_ctx: tokens a
        chunk (at most the pass's; None: the pass's)."""
        ids = np.asarray(tokens, dtype=np.int32)                             # (N,)
        m, cfg = self.model, self.config
        step = min(n_ctx or self.n_ctx, self.n_ctx)
        bounds = [(a, min(a + step, len(ids))) for a in range(0, len(ids), step)]
        x = np.concatenate([m._embed(ids[a:b], np.arange(b - a, dtype=np.int32))
                            for a, b in bounds])                             # (N, d_model)
        for i in range(cfg.n_layers):
            layer, m.ffn = self._layer(i), self._ffn(i, thresholds)
            h = np.empty_like(x) if on_input is not None else None           # (N, d_model)
            for a, b in bounds:
                xc = x[a:b]                                                  # (T, d_model) view
                m._attention_block(i, layer, xc, np.arange(b - a, dtype=np.int32), b - a)
                if h is not None:
                    h[a:b] = m._norm(xc, layer.ffn_norm, layer.ffn_norm_b)
                for c in range(0, b - a, FFN_TOKENS):     # each token's FFN is its own
                    m._ffn_block(i, layer, xc[c:c + FFN_TOKENS])
            m.ffn = None
            del layer
            trim_heap()
            if on_input is not None:
                on_input(i, h)
            on_layer(i)
        return x

    def _layer(self, i: int):
        """Layer i's attention read now, q / k / v fused and packed as a resident model has it."""
        L = fuse_qkv(load_layer(self.flash, i))
        return replace(L, **{n: kernel.pack(w, in_place=True) or w
                             for n, w in L.matrices().items()})

    def _ffn(self, i: int, thresholds: Optional[list]) -> DenseFfn:
        if thresholds is None:
            return DenseFfn(self.flash, self.n_threads, layers=[i])
        ffn = DenseFfn(self.flash, self.n_threads, threshold=[1.0] * self.config.n_layers,
                       layers=[i])                       # built with thresholds: the bundles
        ffn.threshold = list(thresholds)
        return ffn

    def head_input(self, x: np.ndarray) -> np.ndarray:
        """(T, d_embed) the output head's inputs of final hidden states x (T, d_model)."""
        m = self.model
        h = m._norm(np.ascontiguousarray(x), self.w.out_norm, self.w.out_norm_b)  # (T, d_model)
        if self.w.proj_out is not None:
            h = kernel.matmul(self.w.proj_out, h, None, self.n_threads)     # (T, d_embed)
        return h

    def nll(self, x: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """(T,) f64 -log softmax(logits)[target] of the head inputs x (T, d_embed), the head
        read in row chunks (a running log-sum-exp over them, FFN_TOKENS rows at a time: no
        (T, vocab) array)."""
        t = self.flash.dense_entry(self.w.head_name)
        rows, cols = t["shape"]
        rb = t["nbytes"] // rows
        top = np.full(len(x), -np.inf)                                       # (T,)
        total, picked = np.zeros(len(x)), np.zeros(len(x))                  # (T,) each
        r0 = 0
        for _, buf, _ in self.w._own_head_chunks():
            n = len(buf) // rb
            w = QTensor(buf.reshape(n, rb), t["dtype"], n, cols)
            for a in range(0, len(x), FFN_TOKENS):
                s = slice(a, a + FFN_TOKENS)
                self._reduce(kernel.matmul(w, x[s], None, self.n_threads), targets[s] - r0,
                             top[s], total[s], picked[s])                   # (t, n) logits
            r0 += n
        return top + np.log(total) - picked

    def _reduce(self, z: np.ndarray, targets: np.ndarray, top: np.ndarray, total: np.ndarray,
                picked: np.ndarray) -> None:
        """Logits z (t, n) of head rows 0..n into the running max top, sum of exp(z - top) total
        and target logit picked (t,) each, in place; targets (t,) relative to the rows."""
        cap = self.config.final_softcap
        if cap:
            z = np.tanh(z / np.float32(cap)) * np.float32(cap)
        z = z.astype(np.float64)                                             # (t, n)
        new = np.maximum(top, z.max(axis=1))                                 # (t,)
        total *= np.exp(top - new)
        total += np.exp(z - new[:, None]).sum(axis=1)
        top[:] = new
        hit = (targets >= 0) & (targets < z.shape[1])                       # (t,)
        picked[hit] = z[hit, targets[hit]]

    def perplexity(self, tokens: Sequence[int], thresholds: Optional[list] = None,
                   on_layer: Callable[[int], None] = lambda i: None) -> float:
        """generation/perplexity.perplexity of the model (no BOS swap) on tokens in chunks of
        n_ctx (or one chunk of them all when fewer; whole chunks only), its FFN over the
        bundles with thresholds (zeros: none), or with None the dense model's own (run)."""
        ctx = min(self.n_ctx, len(tokens))
        if ctx < 4:
            raise ValueError(f"perplexity needs at least 4 tokens, got {len(tokens)}")
        n = len(tokens) // ctx * ctx
        ids = np.asarray(tokens[:n], dtype=np.int32)                         # (n,)
        x = self.run(ids, thresholds=thresholds, on_layer=on_layer, n_ctx=ctx)   # (n, d_model)
        first = ctx // 2
        rows = np.concatenate([np.arange(a + first, a + ctx - 1)
                               for a in range(0, n, ctx)])                   # (scored,)
        return float(np.exp(self.nll(self.head_input(x[rows]), ids[rows + 1]).mean()))

    def close(self) -> None:
        self.w.close()
