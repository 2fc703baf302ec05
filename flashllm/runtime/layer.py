"""One transformer block's dense weights as the forward pass takes them (runtime/model.py).

A resident layer's q, k and v matrices are fused into one (`fuse_qkv`) when they share a dtype:
a decode token then makes one matrix product where it made three, which on a small model is a
tenth of its time (each product of a 192 x 576 matrix is mostly the call: Python, the kernel's
threads). Each row's product does not depend on the rows beside it, and the matrices join at
multiples of ROW_ALIGN rows, where the kernels' row tiles and packed groups start anyway, so
q, k and v get the bits of three separate products.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

import numpy as np

from flashllm.model.archs.tensors import ATTN_MATRICES, LAYER
from flashllm.model.tensor import QTensor

ROW_ALIGN = 16      # fused matrices join at multiples of this many rows: where the kernels'
                    # row tiles (4), int8 GEMM panels (16) and packed groups (16) start


@dataclass
class Layer:
    """One transformer block's attention, norms and biases. Matrices are QTensors (PackedTensors
    when resident and packed: DenseWeights(pack=True)), vectors f32. With wqkv (fuse_qkv), wq,
    wk and wv are None and bq, bk, bv live in bqkv."""
    attn_norm: np.ndarray               # (d_model,)
    attn_norm_b: Optional[np.ndarray]   # (d_model,) LayerNorm models only
    wq: Optional[QTensor]               # (n_heads * hd, d_model)
    wk: Optional[QTensor]               # (n_kv * hd, d_model)
    wv: Optional[QTensor]               # (n_kv * hd, d_model)
    wo: QTensor                         # (d_model, n_heads * hd)
    bq: Optional[np.ndarray]            # (n_heads * hd,)
    bk: Optional[np.ndarray]            # (n_kv * hd,)
    bv: Optional[np.ndarray]            # (n_kv * hd,)
    bo: Optional[np.ndarray]            # (d_model,)
    ffn_norm: np.ndarray                # (d_model,)
    ffn_norm_b: Optional[np.ndarray]    # (d_model,)
    down_b: Optional[np.ndarray]        # (d_model,)
    q_norm: Optional[np.ndarray] = None # (hd,), or (n_heads * hd,) over the whole q (OLMoE)
    k_norm: Optional[np.ndarray] = None # (hd,), or (n_kv * hd,)
    post_attn_norm: Optional[np.ndarray] = None  # (d_model,) sandwich-norm models only
    post_ffn_norm: Optional[np.ndarray] = None   # (d_model,)
    wqkv: Optional[QTensor] = None      # (n_heads * hd + 2 n_kv * hd, d_model): q, k, v rows
    bqkv: Optional[np.ndarray] = None   # (n_heads * hd + 2 n_kv * hd,)

    def matrices(self) -> dict:
        """The layer's matrices by field name (those it has)."""
        return {n: m for n in ("wqkv", "wq", "wk", "wv", "wo")
                if (m := getattr(self, n)) is not None}


def opt_tensor(flash, name: str) -> Optional[np.ndarray]:
    """The tensor `name` if the model has it, else None."""
    return flash.tensor(name) if flash.has(name) else None


VECTOR_FIELDS = {f.name for f in fields(Layer)} - {t.field for t in ATTN_MATRICES} - {"wqkv", "bqkv"}


def attn_names(i: int) -> list[str]:
    """The dense tensor names of layer i's attention matrices (wq, wk, wv, wo)."""
    return [t.at(i) for t in ATTN_MATRICES]


def load_layer(flash, i: int, matrices: Optional[list] = None) -> Layer:
    """Layer i: vectors read now (each field the canonical table gives one, None where the
    model's config holds no such tensor); matrices (wq, wk, wv, wo) given, or read now too."""
    cfg = flash.config
    vectors = {t.field: flash.tensor(t.at(i)) if t.when(cfg) else None
               for t in LAYER if t.field in VECTOR_FIELDS}
    wq, wk, wv, wo = matrices or [flash.tensor(n) for n in attn_names(i)]
    return Layer(wq=wq, wk=wk, wv=wv, wo=wo, **vectors)


def fuse_qkv(L: Layer) -> Layer:
    """L with wq, wk and wv as one matrix wqkv (their rows in that order) and their biases as
    bqkv, when the three are QTensors of one dtype and width whose row counts are multiples of
    ROW_ALIGN; else L as it is."""
    parts = (L.wq, L.wk, L.wv)
    if not all(isinstance(w, QTensor) for w in parts) or \
            len({(w.dtype, w.cols) for w in parts}) != 1 or any(w.rows % ROW_ALIGN for w in parts):
        return L
    data = np.concatenate([w.data for w in parts])                       # (nq + 2 nkv, row bytes)
    wqkv = QTensor(data, L.wq.dtype, len(data), L.wq.cols)
    biases = (L.bq, L.bk, L.bv)
    bqkv = None if all(b is None for b in biases) else np.concatenate(
        [np.zeros(w.rows, np.float32) if b is None else np.asarray(b, np.float32)
         for w, b in zip(parts, biases)])                                # (nq + 2 nkv,)
    return replace(L, wq=None, wk=None, wv=None, bq=None, bk=None, bv=None, wqkv=wqkv, bqkv=bqkv)
