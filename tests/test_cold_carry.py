"""The cold output a self draft borrows (runtime/resident.ColdCarry): what a static pass records
against a numpy FFN over the uncached neurons, and the share a layer lends, fitted from pairs of
adjacent positions."""
from __future__ import annotations

import numpy as np
import pytest

from flashllm.runtime.resident import CARRY_MAX, CARRY_MIN_PAIRS, ColdCarry, carries
from flashllm.sparsity.predictor import AllSlots
from test_sparse_ffn import flash_ffn, neuron_ids, reference_ffn, write_model

CACHED = 40          # of the tiny model's 96 neurons per layer


def _pass(ffn, cfg, rng, T: int, prefill: bool, pos0: int) -> list:
    """One static pass of random inputs through every layer: the inputs h (T, d) per layer."""
    ffn.start_pass(T, prefill=prefill, pos0=pos0)
    hs = []
    for layer in range(cfg.n_layers):
        h = rng.standard_normal((T, cfg.d_model)).astype(np.float32)      # (T, d)
        ffn(layer, h, np.zeros_like(h))
        hs.append(h)
    return hs


def test_a_static_pass_records_what_its_cold_neurons_add(tmp_path):
    cfg, arrays, _ = write_model(tmp_path / "m", True, "f32")
    flash, ffn = flash_ffn(tmp_path / "m", AllSlots(cfg.n_ff), "64MiB", staging_rows=16,
                           capacity=CACHED, n_pinned=CACHED)
    ffn.carry = ColdCarry(cfg.n_layers, cfg.d_model)
    rng = np.random.default_rng(0)
    cold = np.arange(CACHED, cfg.n_ff, dtype=np.int32)                    # (n_ff - CACHED,)
    for T, prefill, pos0 in ((5, True, 0), (3, False, 5), (1, False, 8)):
        hs = _pass(ffn, cfg, rng, T, prefill, pos0)
        rows = hs[0][-1:] if prefill else hs[0]
        assert (ffn.carry.first, ffn.carry.n) == ((pos0 + T - 1, 1) if prefill else (pos0, T))
        for layer, h in enumerate(hs):
            ref = reference_ffn(cfg, arrays, "f32", layer, h[-1:] if prefill else h,
                                neuron_ids(flash, layer, cold), 0.0)      # (rows, d)
            np.testing.assert_allclose(ffn.carry.rows[layer, :len(rows)], ref, atol=1e-4,
                                       rtol=1e-4)


def _feed(carry: ColdCarry, rows: np.ndarray, per_pass: int) -> None:
    """Record rows (n, d) of consecutive positions in passes of per_pass rows, every layer alike."""
    for first in range(0, len(rows), per_pass):
        cold = rows[first:first + per_pass]                                # (k, d)
        carry.start_pass(len(cold), False, first)
        for layer in range(len(carry.rows)):
            carry.record(layer, cold, np.zeros_like(cold))


@pytest.mark.parametrize("rho", [0.0, 0.3, 0.8])
def test_a_layer_lends_the_share_its_adjacent_positions_fit(rho):
    rng = np.random.default_rng(1)
    n, d = 399, 64                                # passes of 3: the last holds n - 3 .. n - 1
    rows = np.zeros((n, d), np.float32)                                   # an AR(1) sequence
    rows[0] = rng.standard_normal(d)
    for t in range(1, n):
        rows[t] = rho * rows[t - 1] + np.sqrt(1 - rho ** 2) * rng.standard_normal(d)
    carry = ColdCarry(2, d)
    _feed(carry, rows[:2], 1)                     # too few pairs yet: nothing is lent
    assert not carry.alpha.any()
    _feed(carry, rows, 3)
    assert carry.pairs.min() >= CARRY_MIN_PAIRS
    np.testing.assert_allclose(carry.alpha, min(rho, CARRY_MAX), atol=0.08)
    x = np.zeros((2, d), np.float32)              # a draft pass at positions n, n + 1
    carry.lend(1, n, x)
    np.testing.assert_allclose(x, np.broadcast_to(carry.alpha[1] * rows[-1], (2, d)), rtol=1e-6)
    x = np.zeros((1, d), np.float32)              # after a rejected guess: the row before it
    carry.lend(0, n - 1, x)
    np.testing.assert_allclose(x[0], carry.alpha[0] * rows[-2], rtol=1e-6)


def test_only_a_cache_of_enough_of_a_layer_lends():
    assert carries(40, 96) and not carries(30, 96) and not carries(96, 96)
