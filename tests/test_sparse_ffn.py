"""The sparse flash FFN against a numpy FFN on the source weights over the same active set; the
flash path with every slot active and threshold 0 gives the dense model's tokens."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flashllm.format.manifest import read_manifest
from flashllm.runtime.budget import parse_budget, plan_budget
from flashllm.format.reader import open_flash
from flashllm.format.files import update_manifest
from flashllm.ffi.reader import Reader
from flashllm.runtime.model import Model
from flashllm.sparsity.predictor import AllSlots
from flashllm.ffi import kernel
from flashllm.storage.readahead import block_step, page_chunks
from flashllm.runtime.assemble import make_sparse_ffn
from tiny_sources import ref_dequant, ref_rows, tiny_arrays, tiny_config, write_arrays

MiB = 1 << 20


def write_model(out, glu: bool, dtype: str, seed: int = 0):
    """A tiny model (layer 0 stored in a random neuron order) and its source arrays."""
    cfg = tiny_config(glu=glu)
    arrays = tiny_arrays(cfg, seed)
    if not glu:   # ReLU with a bias: about half the neurons active, ids index the bias
        for i in range(cfg.n_layers):
            arrays[f"blk.{i}.ffn_up.bias"] = np.random.default_rng(i).standard_normal(cfg.n_ff) \
                .astype(np.float32)
    order = np.random.default_rng(seed + 1).permutation(cfg.n_ff)        # (n_ff,)
    write_arrays(out, cfg, arrays, dtype, orders={0: order})
    return cfg, arrays, order


def reference_ffn(cfg, arrays, dtype, layer, h, neurons, threshold):
    """y (T, d) of the FFN restricted to neuron ids, from the source weights (quantized by gguf-py's
    reference for q8_0), terms with |a| < threshold dropped."""
    def w(name):
        x = arrays[f"blk.{layer}.{name}"]
        return x if dtype == "f32" else ref_dequant(ref_rows(x, dtype), dtype, x.shape[1])
    up = w("ffn_up.weight")[neurons]                                    # (k, d)
    down = arrays[f"blk.{layer}.ffn_down.weight"].T[neurons]            # (k, d)
    down = down if dtype == "f32" else ref_dequant(ref_rows(down, dtype), dtype, cfg.d_model)
    u = h.astype(np.float64) @ up.T.astype(np.float64)                  # (T, k)
    if cfg.glu:
        g = h.astype(np.float64) @ w("ffn_gate.weight")[neurons].T      # (T, k)
        a = g / (1 + np.exp(-g)) * u
    else:
        a = np.maximum(u + arrays[f"blk.{layer}.ffn_up.bias"][neurons], 0)
    a[np.abs(a) < threshold] = 0
    return a @ down                                                     # (T, d)


class Recorded:
    """A predictor returning seeded random slot sets, remembering the last one."""

    nbytes = 0

    def __init__(self, n_ff: int, seed: int):
        self.rng, self.n_ff, self.last = np.random.default_rng(seed), n_ff, None

    def predict(self, layer, h):
        k = int(self.rng.integers(1, self.n_ff))
        self.last = np.sort(self.rng.choice(self.n_ff, size=k, replace=False)).astype(np.int32)
        return self.last


def flash_ffn(path, predictor, budget: str, naive=False, window=2, exact=False, streamed=(),
              **plan_fields):
    """(flash, SparseFlashFfn) with the budget's plan, some of its fields overridden; its read
    stream (static passes) also carries the dense matrices `streamed`."""
    flash = open_flash(path)
    plan = plan_budget(read_manifest(path), parse_budget(budget), 64, process=0, naive=naive)
    plan = dataclasses.replace(plan, **plan_fields)
    reader = Reader(flash.ffn.file, n_threads=2)
    return flash, make_sparse_ffn(flash, predictor, plan, reader, n_threads=1, window=window,
                                  naive=naive, exact=exact, streamed=streamed)


def neuron_ids(flash, layer, slots):
    order = flash.ffn.neuron_order
    return slots if order is None else order[layer][slots]


@pytest.mark.parametrize("glu,dtype,threshold", [(True, "f32", 0.0), (True, "q8_0", 0.5),
                                                 (False, "f32", 0.3), (False, "q8_0", 0.0)])
def test_decode_equals_numpy_on_the_same_active_set(tmp_path, glu, dtype, threshold):
    cfg, arrays, _ = write_model(tmp_path / "m", glu, dtype)
    update_manifest(tmp_path / "m", sparsity={"thresholds": [threshold] * cfg.n_layers})
    pred = Recorded(cfg.n_ff, seed=3)
    # a cache of ~40% of the FFN: hits, evictions (swap-delete) and streamed overflow all happen
    flash, ffn = flash_ffn(tmp_path / "m", pred, "64MiB", staging_rows=14)
    ffn.caches = [type(c)(cfg.n_ff, 40, c.stride, 2, 0) for c in ffn.caches]
    rng = np.random.default_rng(0)
    for i in range(12):
        T = 1 if i % 3 else 3          # a decode pass with two draft guesses: the union predicted
        ffn.start_pass(T, prefill=False)
        for layer in range(cfg.n_layers):
            h = rng.standard_normal((T, cfg.d_model)).astype(np.float32)     # (T, d)
            y = np.zeros_like(h)
            ffn(layer, h, y)
            ref = reference_ffn(cfg, arrays, dtype, layer, h, neuron_ids(flash, layer, pred.last),
                                threshold)
            tol = 1e-4 if dtype == "f32" else 0.03 * np.abs(ref).max() + 1e-3
            np.testing.assert_allclose(y, ref, atol=tol, rtol=1e-4)
    s = ffn.stats()["decode_mean"]
    assert 0 < s["hit_rate"] < 1 and s["streamed"] > 0


@pytest.mark.parametrize("naive", [False, True])
def test_prefill_and_naive_read_whole_layers_in_chunks(tmp_path, naive):
    cfg, arrays, _ = write_model(tmp_path / "m", True, "f32")
    flash, ffn = flash_ffn(tmp_path / "m", AllSlots(cfg.n_ff), "64MiB", naive=naive,
                           staging_rows=10, **({} if naive else {"capacity": 40, "n_pinned": 25}))
    h = np.random.default_rng(1).standard_normal((5, cfg.d_model)).astype(np.float32)  # (5, d)
    for T in (5, 1, 1):
        ffn.start_pass(T, prefill=T > 1)
        for layer in range(cfg.n_layers):
            y = np.zeros((T, cfg.d_model), np.float32)
            ffn(layer, h[:T], y)
            ref = reference_ffn(cfg, arrays, "f32", layer, h[:T], np.arange(cfg.n_ff), 0.0)
            np.testing.assert_allclose(y, ref, atol=1e-4, rtol=1e-4)
    t = ffn.stats()["tokens"]
    assert [r["kind"] for r in t] == ["prefill", "decode", "decode"]
    stride, layers = flash.ffn.stride, cfg.n_layers
    if naive:    # every token reads every bundle (through the read-ahead ring)
        assert t[1]["bytes_requested"] == layers * cfg.n_ff * stride
    else:        # a static slot set pins every cache row; prefill streams the rest
        assert t[0]["bytes_requested"] == layers * (cfg.n_ff - 40) * stride
        assert t[1]["hits"] == layers * 40
        assert t[1]["bytes_requested"] == layers * (cfg.n_ff - 40) * stride   # streamed


def test_bytes_read_per_token_are_the_misses(tmp_path):
    cfg, arrays, _ = write_model(tmp_path / "m", True, "q8_0")
    pred = Recorded(cfg.n_ff, seed=9)
    flash, ffn = flash_ffn(tmp_path / "m", pred, "64MiB", window=3)
    stride, seen = flash.ffn.stride, set()
    assert ffn.plan.capacity == ffn.plan.n_pinned == cfg.n_ff   # it all fits: all pinned
    ffn.caches = [type(c)(cfg.n_ff, cfg.n_ff, c.stride, 3, 0) for c in ffn.caches]  # no pins
    h = np.zeros((1, cfg.d_model), np.float32)
    for _ in range(6):
        y = np.zeros_like(h)
        ffn.start_pass(1, prefill=False)
        ffn(0, h, y)
        misses = sorted(set(pred.last.tolist()) - seen)   # the cache holds every neuron here
        seen |= set(pred.last.tolist())
        t = ffn.stats()["tokens"][-1]
        assert t["bytes_requested"] == len(misses) * stride
        if misses:   # page padding and merge gaps never read past the misses' page span
            base = flash.ffn.layer_offsets[0]
            first = (base + misses[0] * stride) // 4096 * 4096
            last = -(-(base + (misses[-1] + 1) * stride) // 4096) * 4096
            assert t["bytes_requested"] + t["gap_bytes"] <= t["bytes_read"] <= last - first


def greedy(model, prompt, n):
    out, logits = [], model.forward(np.array(prompt), 0)[-1]
    for p in range(len(prompt), len(prompt) + n):
        out.append(int(np.argmax(logits)))
        logits = model.forward(np.array([out[-1]]), p)[0]
    return out


def test_all_slots_threshold_zero_gives_the_dense_tokens_tiny(tmp_path):
    cfg, _, _ = write_model(tmp_path / "m", True, "f32")
    flash, ffn = flash_ffn(tmp_path / "m", AllSlots(cfg.n_ff), "64MiB", staging_rows=16,
                           capacity=30, n_pinned=10)
    dense = Model(open_flash(tmp_path / "m"), n_threads=1, n_ctx=16)
    sparse = Model(flash, n_threads=1, n_ctx=16, ffn=ffn)
    assert greedy(sparse, [1, 5, 9], 10) == greedy(dense, [1, 5, 9], 10)


@pytest.mark.parametrize("name", ["llama", "opt", "qwen3", "phi3", "gemma3", "mistral_window"])
def test_all_slots_gives_the_dense_tokens_tiny_hf(hf_tiny, tmp_path, name):
    """Streaming through the caches and the read-ahead changes no token, on every FFN shape:
    SwiGLU, ReLU, GeGLU with Gemma's post-FFN norm, Phi-3's split gate_up, windowed attention."""
    from flashllm.convert.convert import convert
    folder, _ = hf_tiny(name)
    path = convert(folder, tmp_path / "m", "f32")
    flash, ffn = flash_ffn(path, AllSlots(open_flash(path).config.n_ff), "64MiB",
                           staging_rows=16, capacity=40, n_pinned=10)
    sparse = Model(flash, n_threads=1, n_ctx=32, ffn=ffn)
    dense = Model(open_flash(path), n_threads=1, n_ctx=32)
    assert greedy(sparse, [1, 7, 42, 300], 12) == greedy(dense, [1, 7, 42, 300], 12)


def budget_for(path, cache_fraction: float) -> str:
    """A --dram-budget (bytes) whose neuron caches hold about cache_fraction of the FFN."""
    man = read_manifest(path)
    full = plan_budget(man, parse_budget(str(1 << 40)), 16, process=0)
    fixed = full.total - full.cache_bytes
    return str(int(fixed + cache_fraction * full.cache_bytes))


@pytest.mark.realmodel
def test_all_slots_gives_the_dense_tokens_smollm2_q8_0():
    """The sparse flash FFN (cached rows, then streamed chunks) sums the dense FFN's terms in
    another grouping: with f32 activations (exact) that is f32 rounding only; int8 activations
    would requantize those ULPs into steps of the activation grid, layer after layer."""
    from conftest import _converted
    path = _converted("smollm2-135m", "q8_0", log=lambda m: None)
    flash, ffn = flash_ffn(path, AllSlots(1536), budget_for(path, 0.4), exact=True)
    assert 0 < ffn.plan.capacity < 1536       # part cached, part streamed
    sparse = Model(flash, n_threads=1, n_ctx=64, ffn=ffn, exact=True)
    dense = Model(open_flash(path), 1, 64, exact=True)
    prompt = [1, 504, 3458, 282, 4649, 314]
    assert greedy(sparse, prompt, 12) == greedy(dense, prompt, 12)
    sparse.reset()
    dense.reset()
    a, b = sparse.forward(np.array(prompt), 0), dense.forward(np.array(prompt), 0)  # (6, vocab)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


def test_check_mode_counts_recall_against_the_exact_mask(tmp_path):
    cfg, arrays, order = write_model(tmp_path / "m", True, "f32")
    update_manifest(tmp_path / "m", sparsity={"thresholds": [0.4] * cfg.n_layers})
    pred = Recorded(cfg.n_ff, seed=4)
    flash, ffn = flash_ffn(tmp_path / "m", pred, "64MiB")
    ffn.check = True
    h = np.random.default_rng(2).standard_normal((1, cfg.d_model)).astype(np.float32)   # (1, d)
    ffn.start_pass(1, prefill=False)
    ffn(0, h, np.zeros_like(h))
    g = h @ arrays["blk.0.ffn_gate.weight"].T                            # (1, n_ff) by neuron id
    a = np.abs(g / (1 + np.exp(-g)) * (h @ arrays["blk.0.ffn_up.weight"].T))[0]
    true = set(np.flatnonzero(a >= 0.4).tolist())                       # neuron ids
    found = true & set(order[pred.last].tolist())
    t = ffn.stats()["tokens"][-1]
    assert (t["true_active"], t["true_hits"]) == (len(true), len(found))
    assert t["recall"] == pytest.approx(len(found) / len(true))
    assert t["precision"] == pytest.approx(len(found) / len(pred.last))


def test_static_ring_survives_prefills_between_decodes(tmp_path):
    """Decode, a second prefill (a chat turn), decode again: the read-ahead ring restarts where
    the forward pass is, and the logits stay the dense model's."""
    cfg, _, _ = write_model(tmp_path / "m", True, "f32")
    flash, ffn = flash_ffn(tmp_path / "m", AllSlots(cfg.n_ff), "64MiB", staging_rows=16,
                           capacity=30, n_pinned=10)
    assert ffn.stream is not None and ffn.caches[0].n_pinned == 30  # static: all rows pinned
    sparse = Model(flash, n_threads=1, n_ctx=32, ffn=ffn)
    dense = Model(open_flash(tmp_path / "m"), n_threads=1, n_ctx=32)
    steps = [[1, 5, 9], [4], [7], [2, 3, 8, 6], [11], [12], [13]]
    pos = 0
    for toks in steps:
        a = sparse.forward(np.array(toks), pos)
        b = dense.forward(np.array(toks), pos)
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
        pos += len(toks)
    ffn.close()
    assert not ffn.stream.ring.running


def test_ring_chunks_start_on_pages_so_reads_land_in_place(tmp_path):
    cfg, _, _ = write_model(tmp_path / "m", True, "f32")
    flash, ffn = flash_ffn(tmp_path / "m", AllSlots(cfg.n_ff), "64MiB", staging_rows=160,
                           capacity=30, n_pinned=30)
    f = flash.ffn
    for layer in range(cfg.n_layers):
        chunks = page_chunks(f.layer_offsets[layer], f.stride, 5, cfg.n_ff, 40)
        assert chunks[0][0] == 5 and chunks[-1][1] == cfg.n_ff
        assert all(b == c for (_, b), (c, _) in zip(chunks, chunks[1:]))     # contiguous
        assert all(0 < b - a <= 40 for a, b in chunks)
        assert all((f.layer_offsets[layer] + a * f.stride) % 4096 == 0 for a, _ in chunks[1:])
    ffn.close()


@pytest.mark.parametrize("stride", [3008, 2800, 1728, 1000, 8192])
def test_ring_chunks_start_on_the_kernels_blocks(stride):
    """The caches hold whole blocks of the FFN kernel's sums (budget._cache_rows); the read-ahead's
    chunks after them start on such blocks too, so each layer's FFN is cut where the kernel's
    sums are and a run's text does not depend on its plan (a ring buffer of 1400 rows; strides
    whose page repeats every 1..512 rows)."""
    block = kernel.ffn_block()
    for first in (0, block, 69 * block):
        step = block_step(1400, stride, block)
        assert 0 < step <= 1400 and step % block == 0
        chunks = page_chunks(0, stride, first, 8960, step)
        assert chunks[0][0] == first and chunks[-1][1] == 8960
        assert all(a % block == 0 and 0 < b - a <= step for a, b in chunks)


def test_a_static_pass_sums_the_same_bits_whatever_the_caches_hold(tmp_path):
    """A pass over every neuron (no predictor) gives the residual the same bits whether the
    cache holds none of a layer's bundles (all read through the ring) or its first block: the
    FFN kernel folds whole blocks in order, and the caches and ring chunks cut the layer on
    them. (Cut elsewhere, the sum's grouping followed the cut, and calibrated thresholds then
    turned that last bit into another greedy text.) A cache of pinned rows holds its gate / up
    rows apart from its down columns (NeuronCache.split): the same bits too."""
    cfg, _, _ = write_model(tmp_path / "m", True, "q8_0")
    block = kernel.ffn_block()
    assert cfg.n_ff > block
    rng = np.random.default_rng(7)
    h = rng.standard_normal((3, cfg.d_model)).astype(np.float32)                # (3, d)
    x0 = rng.standard_normal((3, cfg.d_model)).astype(np.float32)               # the residual
    out = []
    for cap in (0, block):
        _, ffn = flash_ffn(tmp_path / "m", AllSlots(cfg.n_ff), "64MiB", capacity=cap,
                           n_pinned=cap)
        assert all((c.down is not None) == (cap > 0) for c in ffn.caches)
        x = x0.copy()
        for _ in range(2):                                                       # two passes
            ffn.start_pass(3, prefill=False)
            for layer in range(cfg.n_layers):
                ffn(layer, h, x)
        ffn.close()
        out.append(x)
    np.testing.assert_array_equal(out[0], out[1])
