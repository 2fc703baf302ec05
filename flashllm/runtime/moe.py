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

import dataclasses
from typing import Callable, Optional

import numpy as np

from flashllm.model.archs.tensors import ROUTER, SHARED_GATE
from flashllm.ffi import kernel, moe as moe_kernel
from flashllm.ffi.heap import huge_empty, trim_heap
from flashllm.format.reader import FlashModel
from flashllm.runtime.expert_math import ExpertMath
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
    largest probabilities in falling order, renormalised to sum to 1 when norm (in C,
    native/moe.c: llama.cpp's softmax, the lower expert of equal probabilities first)."""
    return moe_kernel.route(logits, k, norm)


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


def shared_weight(h: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """sigmoid(h · gate) (T,) f32: the shared expert's weight for each token of h (T, d)."""
    return (1.0 / (1.0 + np.exp(-(h @ gate)))).astype(np.float32)        # (T,)


def add_shared(h: np.ndarray, x: np.ndarray, gate: np.ndarray, run: Callable) -> None:
    """x (T, d) += sigmoid(h · gate) · shared(h); run(h, y) adds the shared expert's FFN into y."""
    y = np.zeros_like(h)                                                 # (T, d)
    run(h, y)
    x += shared_weight(h, gate)[:, None] * y


class MoeFfn(FfnStrategy):
    """Every expert of every layer read into DRAM once (expert rows repacked for this build's
    matmul where it has a packed layout: runtime/expert_math.py); each token runs its top-k
    experts. Expert rows: a layer's pass is one C call (ffi/moe.py, native/moe.c: the pass's
    tokens grouped by expert, the weighted sum); bundles: one expert at a time (mix_experts)."""

    def __init__(self, flash: FlashModel, n_threads: int = 1, exact: bool = False):
        cfg = flash.config
        self.n_ff, self.n_experts = cfg.n_ff, cfg.n_experts
        self.n_threads, self.exact = n_threads, exact
        self.routers = Routers(flash, n_threads)
        self.math = ExpertMath(flash.ffn, cfg.act, n_threads, exact)
        self.experts = [self._load(flash, i) for i in range(cfg.n_layers)]  # per layer, expert
        self.sets = [moe_kernel.ExpertSet(held, cfg.act) for held in self.experts] \
            if flash.ffn.expert_rows else None                          # per layer, or None
        trim_heap()                     # the read buffers and packed copies let go

    def _load(self, flash: FlashModel, layer: int) -> list:
        """Layer's experts (then the shared one, if any), each what ExpertMath.run takes, in
        memory of their own (the layer's read buffer is let go): expert rows in one buffer of
        huge pages (ffi/heap.py: a decode token streams 8 of them a layer)."""
        rows, n = flash.read_ffn_layer(layer), self.n_ff                 # (slots, stride) uint8
        spans = [(e * n, (e + 1) * n) for e in range(self.n_experts)]
        if len(rows) > self.n_experts * n:
            spans.append((self.n_experts * n, len(rows)))
        held = [self.math.matrices(layer, rows[a:b], pack=True) for a, b in spans]
        return [own(e, rows) for e in held] if not flash.ffn.expert_rows else on_huge_pages(held)

    def start_pass(self, n_tokens: int, prefill: bool, pos0: int = 0) -> None:
        pass

    def __call__(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        experts, weights = self.routers.route(layer, h)                  # (T, k), (T, k)
        gate = self.routers.shared_gate[layer]
        if self.sets is not None:        # the shared expert: the last, weighted sigmoid(h · gate)
            if gate is not None:
                experts = np.hstack([experts, np.full((len(h), 1), self.n_experts, np.int32)])
                weights = np.hstack([weights, shared_weight(h, gate)[:, None]])  # (T, k + 1)
            self.sets[layer](experts, weights, h, x, self.exact, self.n_threads)
            return
        held = self.experts[layer]
        mix_experts(h, x, experts, weights,
                    lambda e, hs, ys: self.math.run(layer, held[e], hs, ys))
        if gate is not None:
            add_shared(h, x, gate, lambda hs, ys: self.math.run(layer, held[-1], hs, ys))

    def stats(self) -> dict:
        return {"ffn": "moe (dense)"}


def on_huge_pages(experts: list) -> list:
    """experts (tuples of matrices) copied into one huge-page buffer, each matrix on a 64-byte
    boundary."""
    step = lambda m: -(-m.data.nbytes // 64) * 64                       # noqa: E731
    buf, off, out = huge_empty(sum(step(m) for e in experts for m in e)), 0, []  # (Σ,) uint8
    for e in experts:
        mats = []
        for m in e:
            dst = buf[off:off + m.data.nbytes]                          # (m's bytes,)
            dst[:] = m.data.reshape(-1)
            mats.append(dataclasses.replace(m, data=dst.reshape(m.data.shape)))
            off += step(m)
        out.append(tuple(mats))
    return out


def own(expert, buf: np.ndarray):
    """expert (slots (n, stride), or its matrices) in memory of its own, not a view of buf."""
    if isinstance(expert, np.ndarray):
        return expert.copy() if np.may_share_memory(expert, buf) else expert
    return tuple(dataclasses.replace(m, data=m.data.copy()) if np.may_share_memory(m.data, buf) else m
                 for m in expert)
