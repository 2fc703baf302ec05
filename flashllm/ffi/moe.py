"""A mixture of experts' layer in C (native/moe.c): the routing (fl_moe_route) and every routed
expert of a pass with the weighted sum of their outputs (fl_moe_ffn), one call each a layer.

ExpertSet checks a layer's expert matrices once and keeps the fl_expert array that points into
them (and the arrays, so the pointers stay valid); a call passes the pass's routing and rows.
MoeToken is a decode token's whole layer in one call (fl_moe_token): norm, router, routing and
experts, the bits of runtime/model.py's calls.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from flashllm.errors import KernelError
from flashllm.ffi.block import CStruct, token_row
from flashllm.ffi.kernel import ACT_CODES
from flashllm.ffi.lib import check as _check, ffi, native as _native


def route(logits: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """(experts (T, k) int32 by falling weight, weights (T, k) f32) of router logits (T, E):
    softmax, the k largest probabilities (the lower expert of equals first), renormalised to
    sum to 1 when norm (fl_moe_route)."""
    lg = np.ascontiguousarray(logits, dtype=np.float32)                  # (T, E)
    if lg.ndim != 2 or lg.shape[0] < 1 or not 1 <= k <= lg.shape[1]:
        raise KernelError(f"route: logits must be (T, E) with 1 <= k <= E, got {lg.shape}, k={k}")
    experts = np.empty((lg.shape[0], k), np.int32)                       # (T, k)
    weights = np.empty((lg.shape[0], k), np.float32)                     # (T, k)
    _check(_native().fl_moe_route(ffi.from_buffer("float[]", lg), lg.shape[0], lg.shape[1], k,
                                  int(norm), ffi.from_buffer("int32_t[]", experts),
                                  ffi.from_buffer("float[]", weights)), "moe_route")
    return experts, weights


class ExpertSet(CStruct):
    """A layer's experts (and its shared expert, last) as moe.c takes them: x += their FFN."""

    def __init__(self, experts: Sequence[tuple], act: str):
        """experts: per expert ([gate; up] (2 n_ff, d), down (d, n_ff)), QTensor or PackedTensor."""
        super().__init__("fl_expert[]", len(experts))
        if act not in ACT_CODES:
            raise KernelError(f"unknown activation {act!r}: expected one of {', '.join(ACT_CODES)}")
        for i, (gate_up, down) in enumerate(experts):
            self.mat(self.c[i].gate_up, gate_up, None, f"expert {i} gate_up")
            self.mat(self.c[i].down, down, None, f"expert {i} down")
        self.n, self.act, self.d = len(experts), ACT_CODES[act], experts[0][1].rows

    def __call__(self, ids: np.ndarray, weights: np.ndarray, h: np.ndarray, x: np.ndarray,
                 exact: bool = False, n_threads: int = 1) -> None:
        """x (T, d) += Σ_j weights[t, j] · expert_{ids[t, j]}(h[t]) (fl_moe_ffn), in place."""
        T, d = h.shape
        ids = np.ascontiguousarray(ids, dtype=np.int32)                  # (T, k)
        w = np.ascontiguousarray(weights, dtype=np.float32)              # (T, k)
        if ids.ndim != 2 or w.shape != ids.shape or ids.shape[0] != T or d != self.d:
            raise KernelError(f"moe_ffn: ids {ids.shape}, weights {w.shape}, h {h.shape} "
                              f"for d_model {self.d}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.n):
            raise KernelError(f"moe_ffn: expert ids must lie in [0, {self.n})")
        for a, name, wr in ((h, "h", False), (x, "x", True)):
            if a.dtype != np.float32 or a.shape != (T, d) or not a.flags.c_contiguous or \
                    (wr and not a.flags.writeable):
                raise KernelError(f"moe_ffn: {name} must be a contiguous float32 ({T}, {d}) array")
        _check(_native().fl_moe_ffn(self.c, self.n, ffi.from_buffer("int32_t[]", ids),
                                    ffi.from_buffer("float[]", w), T, ids.shape[1], self.act,
                                    ffi.from_buffer("float[]", h), ffi.from_buffer("float[]", x),
                                    d, int(exact), int(n_threads)), "moe_ffn")


class MoeToken(CStruct):
    """A mixture of experts' layer for one token (fl_moe_token): x (1, d) += it, in place."""

    def __init__(self, norm: np.ndarray, router, experts: ExpertSet, k: int, norm_topk: bool,
                 eps: float):
        """router (n_experts, d) QTensor, run as an exact f32 product; experts: the layer's."""
        super().__init__("fl_moe_block *")
        b, d = self.c, experts.d
        if router.rows != experts.n or router.cols != d or not 1 <= k <= experts.n:
            raise KernelError(f"moe_token: router {router.rows}x{router.cols}, k={k} for "
                              f"{experts.n} experts of d_model {d}")
        b.norm = self.vec(norm, d, "norm")
        self.mat(b.router, router, None, "router")
        b.experts, b.n_experts, b.k = experts.c, experts.n, k
        b.norm_topk, b.act, b.eps = int(norm_topk), experts.act, eps
        self._alive.append(experts)
        self.d = d

    def __call__(self, x: np.ndarray, n_threads: int) -> None:
        _check(_native().fl_moe_token(self.c, token_row(x, self.d), self.d, int(n_threads)),
               "moe_token")
