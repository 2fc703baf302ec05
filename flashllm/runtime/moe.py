"""Mixture-of-experts FFN in DRAM, and the routing every MoE strategy shares.

A layer's FFN slots in ffn.bin (docs/FORMAT.md) are its experts, one after another (expert e at
slots e·n_ff .. (e+1)·n_ff-1), then the shared expert's. Per token, as transformers' MoE blocks
compute it:

    p = softmax(router · h)                          router (n_experts, d_model), resident, f32
    experts, w = top-k of p [/ their sum when norm_topk]
    x += Σ w_k · expert_k(h)  [+ sigmoid(shared_gate · h) · shared_expert(h)]

Each expert is a gated FFN over its own bundles (kernel.ffn_bundles), so the expert strategy that
streams them (runtime/expert_ffn.py) computes the same sums over bundles it read from flash.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from flashllm.model.archs.tensors import ROUTER, SHARED_GATE
from flashllm.ffi import kernel
from flashllm.format.reader import FlashModel
from flashllm.runtime.interfaces import FfnStrategy

RunExpert = Callable[[int, np.ndarray, np.ndarray], None]   # (expert, h (n, d), y (n, d)): y += FFN


class Routers:
    """Every layer's router (n_experts, d_model) and shared-expert gate (d_model,) or None."""

    def __init__(self, flash: FlashModel, n_threads: int = 1):
        cfg = flash.config
        self.k, self.norm_topk, self.n_threads = cfg.n_experts_used, cfg.norm_topk, n_threads
        self.weights = [flash.tensor(f"blk.{i}.{ROUTER}")                  # QTensor (n_exp, d)
                        for i in range(cfg.n_layers)]
        self.shared_gate = [flash.tensor(f"blk.{i}.{SHARED_GATE}") if cfg.n_ff_shared else None
                            for i in range(cfg.n_layers)]                  # (d,) each

    @property
    def nbytes(self) -> int:
        return sum(w.data.nbytes for w in self.weights) + \
            sum(g.nbytes for g in self.shared_gate if g is not None)

    def route(self, layer: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(experts (T, k) int32 by falling weight, weights (T, k) f32) of h (T, d_model)."""
        logits = kernel.matmul(self.weights[layer], h, None, self.n_threads, True)   # (T, n_exp)
        return top_k(logits, self.k, self.norm_topk)


def top_k(logits: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """(experts (T, k) int32, weights (T, k) f32): softmax over logits (T, n_experts), the k
    largest probabilities in falling order, renormalised to sum to 1 when norm."""
    z = logits - logits.max(axis=1, keepdims=True)                       # (T, n_exp)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)                                    # (T, n_exp)
    idx = np.argsort(-p, axis=1, kind="stable")[:, :k].astype(np.int32)  # (T, k)
    w = np.take_along_axis(p, idx, axis=1).astype(np.float32)            # (T, k)
    if norm:
        w /= w.sum(axis=1, keepdims=True)
    return idx, w


def mix_experts(h: np.ndarray, x: np.ndarray, experts: np.ndarray, weights: np.ndarray,
                run: RunExpert, order: Optional[list] = None) -> None:
    """x (T, d) += Σ_k weights[t, k] · expert_{experts[t, k]}(h[t]); run(e, hs, ys) adds expert
    e's FFN of the tokens hs (n, d) routed to it into ys (n, d). order: the experts in the order
    to run them (default: ascending)."""
    for e in (np.unique(experts) if order is None else order):
        t, j = np.nonzero(experts == e)                                  # (n,) tokens, (n,) rank
        hs = np.ascontiguousarray(h[t])                                  # (n, d)
        ys = np.zeros_like(hs)                                           # (n, d)
        run(int(e), hs, ys)
        x[t] += weights[t, j, None] * ys


def add_shared(h: np.ndarray, x: np.ndarray, gate: np.ndarray, run: Callable) -> None:
    """x (T, d) += sigmoid(h · gate) · shared(h); run(h, y) adds the shared expert's FFN into y."""
    y = np.zeros_like(h)                                                 # (T, d)
    run(h, y)
    g = 1.0 / (1.0 + np.exp(-(h @ gate)))                                # (T,)
    x += g[:, None].astype(np.float32) * y


class MoeFfn(FfnStrategy):
    """Every expert of every layer read into DRAM once; each token runs its top-k experts."""

    def __init__(self, flash: FlashModel, n_threads: int = 1, exact: bool = False):
        cfg = flash.config
        self.dtype, self.d, self.act, self.n_ff = flash.ffn.dtype, cfg.d_model, cfg.act, cfg.n_ff
        self.n_experts, self.n_threads, self.exact = cfg.n_experts, n_threads, exact
        self.routers = Routers(flash, n_threads)
        self.bundles = [np.ascontiguousarray(flash.read_ffn_layer(i))   # (slots, stride) uint8
                        for i in range(cfg.n_layers)]

    def start_pass(self, n_tokens: int, prefill: bool, pos0: int = 0) -> None:
        pass

    def __call__(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        experts, weights = self.routers.route(layer, h)                  # (T, k), (T, k)
        rows = self.bundles[layer]                                       # (slots, stride)
        n = self.n_ff
        mix_experts(h, x, experts, weights,
                    lambda e, hs, ys: self.run(rows[e * n:(e + 1) * n], hs, ys))
        gate = self.routers.shared_gate[layer]
        if gate is not None:
            add_shared(h, x, gate, lambda hs, ys: self.run(rows[self.n_experts * n:], hs, ys))

    def run(self, bundles: np.ndarray, h: np.ndarray, y: np.ndarray) -> None:
        """y (n, d) += the gated FFN of h (n, d) over bundles (m, stride)."""
        kernel.ffn_bundles(bundles, self.dtype, self.d, True, self.act, h, y,
                           n_threads=self.n_threads, exact=self.exact)

    def stats(self) -> dict:
        return {"ffn": "moe (dense)"}
