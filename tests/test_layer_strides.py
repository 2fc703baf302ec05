"""Per-layer bundle strides (a native conversion whose layers keep their down columns in
different k-quants, docs/FORMAT.md): the sparse flash FFN — caches, the static read-ahead ring,
predicted decode passes, streamed prefill chunks — computes what the dense FFN over the same
folder computes, reads each layer at its own stride, and the budget counts each layer's bytes.
The reference is the dense FFN (every bundle read whole by FlashModel.read_ffn_layer), which
tests/test_convert_native.py checks against gguf-py.
"""
import numpy as np
import pytest

from flashllm.convert.convert import convert
from flashllm.ffi import kernel
from flashllm.format.reader import open_flash
from flashllm.format.manifest import read_manifest
from flashllm.runtime.budget import ROW_MAP_BYTES, parse_budget, plan_budget
from flashllm.runtime.model import Model
from flashllm.sparsity.predictor import AllSlots
from gguf import GGMLQuantizationType as Q

from test_convert_native import FF, TYPES, write_mixed_gguf
from test_sparse_ffn import Recorded, flash_ffn, greedy


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("strides")
    write_mixed_gguf(tmp / "m.gguf", np.random.default_rng(7))
    out = convert(tmp / "m.gguf", tmp / "native", None)
    assert open_flash(out).ffn.strides == (576, 544)                    # q6_k, q5_k columns
    return out


@pytest.fixture(scope="module")
def rising(tmp_path_factory):
    """The layers the other way round: the wider stride second (a prefill reading the next
    layer's first chunk ahead must size it by that layer's stride)."""
    tmp = tmp_path_factory.mktemp("rising")
    write_mixed_gguf(tmp / "m.gguf", np.random.default_rng(7),
                     {**TYPES, "down0": Q.Q4_K, "down1": Q.Q6_K})
    out = convert(tmp / "m.gguf", tmp / "native", None)
    assert open_flash(out).ffn.strides == (544, 576)
    return out


@pytest.mark.parametrize("capacity, pinned", [(0, 0), (100, 100)])
def test_static_ring_gives_the_dense_logits(mixed, capacity, pinned):
    flash, ffn = flash_ffn(mixed, AllSlots(FF), "64MiB", exact=True, staging_rows=24,
                           capacity=capacity, n_pinned=pinned)
    assert ffn.stream is not None
    sparse = Model(flash, n_threads=1, n_ctx=16, ffn=ffn, exact=True)
    dense = Model(open_flash(mixed), n_threads=1, n_ctx=16, exact=True)
    prompt = [1, 17, 5, 39]
    assert greedy(sparse, prompt, 6) == greedy(dense, prompt, 6)
    sparse.reset()
    dense.reset()
    a, b = sparse.forward(np.array(prompt), 0), dense.forward(np.array(prompt), 0)   # (4, 40)
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
    t = ffn.stats()["tokens"][-1]
    assert t["bytes_requested"] == (FF - pinned) * (576 + 544)          # each layer its stride


@pytest.mark.parametrize("folder", ["mixed", "rising"])
def test_predicted_decode_and_streamed_prefill_give_the_dense_ffn(folder, request):
    """Random predicted sets through small caches (hits, evictions, overflow streamed), and a
    prefill streamed through the staging halves, each layer seen at its own stride."""
    mixed = request.getfixturevalue(folder)
    flash, ffn = flash_ffn(mixed, Recorded(FF, seed=4), "64MiB", exact=True, staging_rows=30)
    ffn.caches = [type(c)(FF, 60, c.stride, 2, 20) for c in ffn.caches]
    for layer, cache in enumerate(ffn.caches):
        ffn.reads.read_seq(layer, cache.pin(), cache.matrix, None)
    dense = Model(open_flash(mixed), n_threads=1, n_ctx=16, exact=True).ffn
    rng = np.random.default_rng(0)
    for i in range(8):
        T = 5 if i == 0 else 1
        ffn.start_pass(T, prefill=T > 1)
        for layer in range(2):
            h = rng.standard_normal((T, 256)).astype(np.float32)               # (T, d)
            y = np.zeros_like(h)
            ffn(layer, h, y)
            slots = np.arange(FF) if T > 1 else ffn.predictor.last
            ref = np.zeros_like(h)
            kernel.ffn_bundles(dense.bundles[layer], "q5_k", 256, True, "silu", h, ref,
                               rows=np.asarray(slots, np.int32), exact=True,
                               down_dtype=flash.ffn.down_dtypes[layer])
            np.testing.assert_allclose(y, ref, atol=1e-5 * np.abs(ref).max(), rtol=1e-4)
    s = ffn.stats()["decode_mean"]
    assert 0 < s["hit_rate"] < 1


def test_the_budget_counts_each_layers_stride(mixed):
    man = read_manifest(mixed)
    plan = plan_budget(man, parse_budget("64MiB"), 16, process=0)
    assert (plan.stride, plan.strides) == (576, 576 + 544)
    assert plan.cache_bytes == plan.capacity * (576 + 544 + 2 * ROW_MAP_BYTES) + 2 * 4 * FF


def test_hot_first_rewrite_keeps_each_layers_stride(mixed, tmp_path):
    """Calibration's hot-first rewrite moves each layer's slots at its own stride and keeps
    its entry's stride, down dtype and origin: the FFN computes the same sums, by neuron id."""
    import shutil
    from flashllm.sparsity.reorder import rewrite_hot_first
    folder = tmp_path / "m"
    shutil.copytree(mixed, folder)
    before = Model(open_flash(folder), n_threads=1, n_ctx=16, exact=True)
    x = np.random.default_rng(5).standard_normal((3, 256)).astype(np.float32)   # (3, d)
    want = [np.zeros_like(x) for _ in range(2)]
    for layer in range(2):
        before.ffn(layer, x, want[layer])
    freq = np.random.default_rng(6).random((2, FF)).astype(np.float32)          # (2, n_ff)
    rewrite_hot_first(open_flash(folder), freq, {})
    flash = open_flash(folder, verify=True)
    old = open_flash(mixed).manifest["ffn"]["layers"]
    for layer, e in enumerate(flash.manifest["ffn"]["layers"]):
        assert {k: e[k] for k in ("stride", "down_dtype", "origin", "offset")} == \
            {k: old[layer][k] for k in ("stride", "down_dtype", "origin", "offset")}
    assert flash.ffn.neuron_order is not None and flash.ffn.strides == (576, 544)
    after = Model(flash, n_threads=1, n_ctx=16, exact=True)
    for layer in range(2):
        y = np.zeros_like(x)
        after.ffn(layer, x, y)
        np.testing.assert_allclose(y, want[layer], rtol=1e-4, atol=1e-5 * np.abs(want[layer]).max())
