"""A layer's q, k and v fused into one matrix (runtime/layer.py fuse_qkv): one product gives each
of q, k and v the bits of its own product (the kernels compute every row apart from its
neighbours; the matrices join where row tiles, panels and packed groups start), packed or not,
for a decode token, a verifying pass and a prompt's panels; and only matrices that can join do."""
from dataclasses import replace

import numpy as np
import pytest

from flashllm.ffi import kernel
from flashllm.model.tensor import QTensor
from flashllm.runtime.layer import Layer, fuse_qkv
from test_pack import TYPES, rows_of

COLS = 512
ROWS = (64, 32, 32)                       # q, k, v: 4 heads and 2 kv heads of 16


def layer_of(dtypes, rows=ROWS, biases=(True, False, True)) -> Layer:
    """A Layer whose q, k, v are random rows of these dtypes (the rest of it unused here)."""
    rng = np.random.default_rng(11)
    ws = [QTensor(np.ascontiguousarray(rows_of(rng, TYPES[t], n, COLS)), t, n, COLS)
          for t, n in zip(dtypes, rows)]
    bs = [rng.normal(size=n).astype(np.float32) if b else None for n, b in zip(rows, biases)]
    d = np.ones(COLS, np.float32)
    return Layer(attn_norm=d, attn_norm_b=None, wq=ws[0], wk=ws[1], wv=ws[2], wo=ws[0],
                 bq=bs[0], bk=bs[1], bv=bs[2], bo=None, ffn_norm=d, ffn_norm_b=None, down_b=None)


@pytest.mark.parametrize("dtype", list(TYPES))
@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("T", [1, 3, 12])
def test_one_product_gives_each_matrix_its_own_bits(dtype, pack, T):
    L = layer_of([dtype] * 3)
    F = fuse_qkv(L)
    assert F.wq is None and F.wqkv.rows == sum(ROWS)
    w = kernel.pack(F.wqkv) if pack else None
    if pack and w is None:
        pytest.skip("this build has no packed layout for it (AVX-512 VNNI)")
    x = np.random.default_rng(T).normal(size=(T, COLS)).astype(np.float32)   # (T, COLS)
    y = kernel.matmul(w or F.wqkv, x, F.bqkv, n_threads=2)                  # (T, 128)
    cuts = np.cumsum((0,) + ROWS)
    for (a, b), m, bias in zip(zip(cuts, cuts[1:]), (L.wq, L.wk, L.wv), (L.bq, L.bk, L.bv)):
        own = kernel.matmul((kernel.pack(m) if pack else None) or m, x, bias, n_threads=2)
        np.testing.assert_array_equal(y[:, a:b], own)


def test_matrices_of_other_dtypes_or_unaligned_rows_stay_apart():
    assert fuse_qkv(layer_of(["q4_k", "q4_k", "q6_k"])).wqkv is None     # a Q4_K_M layer's v
    assert fuse_qkv(layer_of(["q8_0"] * 3, rows=(48, 24, 24))).wqkv is None   # 24 rows: no
    L = layer_of(["q8_0"] * 3, biases=(False, False, False))
    F = fuse_qkv(L)
    assert F.bqkv is None and F.wqkv is not None
    np.testing.assert_array_equal(F.wqkv.data, np.concatenate([L.wq.data, L.wk.data, L.wv.data]))


def test_a_streamed_layer_is_never_fused():
    L = replace(layer_of(["q8_0"] * 3), wq=None, wk=None, wv=None)       # matrices not read yet
    assert fuse_qkv(L) is L
