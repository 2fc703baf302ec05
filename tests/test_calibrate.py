"""Calibration statistics against transformers (FFN inputs, exact activations) and numpy
(thresholds, frequencies); hot-first rewrite against the model before reordering."""
from __future__ import annotations

import numpy as np
import pytest

from hf_tiny import VOCAB

from flashllm.bundle import open_flash
from flashllm.calibrate import (CalibrationError, active_mask, collect_ffn_inputs, ffn_activations,
                                frequencies, layer_thresholds, threshold)
from flashllm.convert import convert

TOKENS = np.random.default_rng(7).integers(3, VOCAB, size=48)        # (48,)
N_CTX = 24


@pytest.fixture(scope="module")
def tiny(hf_tiny, tmp_path_factory):
    """name -> (transformers model, f32 flash folder)."""
    made = {}

    def get(name: str):
        if name not in made:
            folder, hf = hf_tiny(name)
            out = tmp_path_factory.mktemp(f"flash_{name}") / "m"
            convert(folder, out, "f32")
            made[name] = (hf, out)
        return made[name]
    return get


def _mlps(hf):
    """Per layer (module whose input is the FFN input h, function h -> reference activation)."""
    import torch
    if hasattr(hf.model, "decoder"):                                  # OPT: fc1 then relu
        layers = hf.model.decoder.layers
        return [(L.fc1, lambda h, L=L: torch.relu(L.fc1(h))) for L in layers]
    return [(L.mlp, lambda h, L=L: L.mlp.act_fn(L.mlp.gate_proj(h)) * L.mlp.up_proj(h))
            for L in hf.model.layers]


def _reference_inputs(hf, tokens, n_ctx):
    """Per layer the (N, d) FFN inputs transformers sees, chunk by chunk from an empty context."""
    import torch
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, i=i: seen.setdefault(i, []).append(
        args[0].detach().reshape(-1, args[0].shape[-1]).numpy().copy())) for i, (m, _) in enumerate(_mlps(hf))]
    try:
        with torch.no_grad():
            for s in range(0, len(tokens), n_ctx):
                hf(torch.tensor(tokens[s:s + n_ctx])[None])
    finally:
        for h in hooks:
            h.remove()
    return [np.concatenate(seen[i]) for i in range(len(seen))]


@pytest.mark.parametrize("name", ["llama", "qwen2_tied", "opt"])
def test_inputs_and_activations_match_transformers(tiny, name):
    import torch
    hf, path = tiny(name)
    flash = open_flash(path)
    ours = collect_ffn_inputs(flash, TOKENS, n_ctx=N_CTX)
    ref = _reference_inputs(hf, TOKENS, N_CTX)
    crit = "glu_product" if flash.config.glu else "relu"
    for layer, (h_ours, h_ref) in enumerate(zip(ours, ref)):
        assert h_ours.shape == h_ref.shape == (len(TOKENS), flash.config.d_model)
        np.testing.assert_allclose(h_ours, h_ref, rtol=1e-4, atol=1e-4 * np.abs(h_ref).max())
        with torch.no_grad():
            want = _mlps(hf)[layer][1](torch.from_numpy(h_ref)).numpy()    # (N, n_ff)
        got = ffn_activations(flash, layer, h_ref, crit)                    # (N, n_ff)
        want = np.abs(want) if crit == "glu_product" else want
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_callback_sees_every_chunk_of_every_layer(tiny):
    _, path = tiny("llama")
    flash = open_flash(path)
    calls = []
    assert collect_ffn_inputs(flash, TOKENS, n_ctx=N_CTX,
                              on_input=lambda l, h: calls.append((l, h.shape))) is None
    d, L = flash.config.d_model, flash.config.n_layers
    assert calls == [(l, (N_CTX, d)) for _ in range(2) for l in range(L)]


def test_gate_criterion_is_cats(tiny):
    import torch
    hf, path = tiny("llama")
    flash = open_flash(path)
    h = np.random.default_rng(3).standard_normal((5, flash.config.d_model)).astype(np.float32)
    mlp = hf.model.layers[1].mlp
    with torch.no_grad():
        want = np.abs(mlp.act_fn(mlp.gate_proj(torch.from_numpy(h))).numpy())
    np.testing.assert_allclose(ffn_activations(flash, 1, h, "gate"), want, rtol=1e-4, atol=1e-6)
    with pytest.raises(CalibrationError, match="GLU"):
        ffn_activations(open_flash(tiny("opt")[1]), 0, h[:, :64], "gate")


@pytest.mark.parametrize("s", [0.0, 0.3, 0.5, 0.7, 0.95, 1.0])
def test_threshold_gives_the_target_sparsity(s):
    scores = np.abs(np.random.default_rng(1).standard_normal((300, 77))).astype(np.float32)
    t = threshold(scores, s)
    below = (scores < t).mean()
    assert below == pytest.approx(round(s * scores.size) / scores.size, abs=0)
    if 0 < s < 1:   # numpy's quantile at the order statistic k = round(s * N)
        k = round(s * scores.size)
        assert t == np.quantile(scores, k / (scores.size - 1), method="nearest")
    assert active_mask(scores, t, "glu_product").mean() == pytest.approx(1 - below)


def test_layer_thresholds_and_frequencies_vs_numpy():
    rng = np.random.default_rng(2)
    acts = [np.abs(rng.standard_normal((200, 50)) * rng.uniform(0.1, 3, 50)).astype(np.float32)
            for _ in range(3)]                                           # per layer (200, 50)
    ts = layer_thresholds(acts, 0.6)
    for a, t in zip(acts, ts):
        assert t == pytest.approx(float(np.sort(a.ravel())[round(0.6 * a.size)]))
        f = frequencies(a, t, "glu_product")
        np.testing.assert_array_equal(f, [(a[:, j] >= t).sum() / 200 for j in range(50)])
    relu = np.maximum(rng.standard_normal((10, 4)), 0)
    np.testing.assert_array_equal(frequencies(relu, 123.0, "relu"), (relu > 0).mean(0))
    with pytest.raises(CalibrationError, match="sparsity"):
        threshold(acts[0], 1.5)
