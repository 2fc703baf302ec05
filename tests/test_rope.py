"""RoPE frequencies (model/rope.py) against transformers' own rope initialisation
(modeling_rope_utils.ROPE_INIT_FUNCTIONS), read from config.json in both key styles:
transformers 5's rope_parameters and transformers 4's rope_theta + rope_scaling."""
from __future__ import annotations

import numpy as np
import pytest

from flashllm.model.rope import hf_rope, inv_freq

LLAMA31 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)     # Llama 3.1's rope_scaling
LLAMA32 = dict(LLAMA31, factor=32.0)                      # Llama 3.2 1B / 3B


@pytest.mark.parametrize("spec", [LLAMA31, LLAMA32, dict(rope_type="linear", factor=4.0)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_scaled_frequencies_match_transformers(spec, head_dim):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    theta = 500000.0
    cfg = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4,
                                   head_dim=head_dim, max_position_embeddings=131072,
                                   rope_parameters={**spec, "rope_theta": theta})
    ref, scale = ROPE_INIT_FUNCTIONS[spec["rope_type"]](cfg, "cpu")       # (head_dim/2,)
    assert scale == 1.0
    for style in ({"rope_parameters": {**spec, "rope_theta": theta}},
                  {"rope_theta": theta, "rope_scaling": spec}):
        got_theta, factors = hf_rope(style, head_dim, "test")
        got = inv_freq(got_theta, head_dim, factors)                     # (head_dim/2,)
        np.testing.assert_allclose(got, ref.double().numpy(), rtol=1e-6)
    assert not np.allclose(inv_freq(theta, head_dim), ref.double().numpy(), rtol=1e-3)
