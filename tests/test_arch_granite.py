"""Granite (flashllm/model/archs/granite.py) against transformers' GraniteForCausalLM on tiny
random checkpoints, as tests/test_parity_hf.py checks the other architectures: f32 logits,
prefill then one-token decode, greedy tokens, f16 / q8_0 conversions against a reference whose
weights are rounded the same way; and the GGUF form llama.cpp's converter writes (GraniteModel is
a LlamaModel: attn_q / attn_k permuted, the four scales as granite.* keys).

Every scale is set away from 1 (a missing multiply would pass at 1): embedding_multiplier 12,
attention_multiplier 0.1 (not head_dim^-0.5 = 0.25), residual_multiplier 0.22, logits_scaling 8
(Granite 3.0 2B's values but the attention one)."""
from __future__ import annotations

import numpy as np
import pytest

import hf_tiny
from gguf_tiny import _metadata as gguf_metadata, llamacpp_permute
from test_parity_hf import PROMPT, TOL_VS_ORIGINAL, TOL_VS_ROUNDED, hf_logits, rel_err, \
    rounded_reference

from flashllm.convert.convert import convert
from flashllm.errors import SourceError
from flashllm.format.reader import open_flash
from flashllm.generation.generate import generate
from flashllm.generation.sampler import Sampler, SamplerParams
from flashllm.runtime.model import Model

SCALES = dict(embedding_multiplier=12.0, attention_multiplier=0.1, residual_multiplier=0.22,
              logits_scaling=8.0)
TINY = {
    "granite": ("GraniteConfig", dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      rope_theta=10000.0, rms_norm_eps=1e-5,
                                      tie_word_embeddings=True, **SCALES)),
    # q/k/v/o biases (attention_bias), an untied head, 3 layers without GQA
    "granite_bias": ("GraniteConfig", dict(hidden_size=96, intermediate_size=128,
                                           num_hidden_layers=3, num_attention_heads=4,
                                           num_key_value_heads=4, attention_bias=True,
                                           rope_theta=50000.0, rms_norm_eps=1e-6,
                                           tie_word_embeddings=False, **SCALES)),
}
NAMES = list(TINY)


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    """load(name, dtype) -> (Model, transformers model, HF folder), converted once each."""
    hf_tiny.require_transformers()
    built, models = {}, {}

    def load(name: str, dtype: str = "f32"):
        if name not in models:
            with pytest.MonkeyPatch.context() as mp:       # hf_tiny builds from its TINY table
                mp.setitem(hf_tiny.TINY, name, TINY[name])
                models[name] = hf_tiny.make_tiny(name, tmp_path_factory.mktemp(name))
        if (name, dtype) not in built:
            folder, hf = models[name]
            out = convert(folder, tmp_path_factory.mktemp(f"{name}_{dtype}") / "m", dtype)
            # f32: `run`'s default path (exact=False: one-token passes through the C blocks
            # where they qualify); quantized: f32 activations, to meet the rounded reference
            built[name, dtype] = Model(open_flash(out), n_threads=2, n_ctx=128,
                                       exact=dtype != "f32")
        return built[name, dtype], models[name][1], models[name][0]

    return load


def greedy_hf(hf, prompt: np.ndarray, n: int) -> list[int]:
    import torch
    eos, hf.generation_config.eos_token_id = hf.generation_config.eos_token_id, None
    try:
        with torch.no_grad():
            seq = hf.generate(torch.as_tensor(prompt).reshape(1, -1), do_sample=False,
                              max_new_tokens=n, pad_token_id=0)
    finally:
        hf.generation_config.eos_token_id = eos
    return seq[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", NAMES)
def test_config_reads_the_four_scales(granite, name):
    net, _, _ = granite(name)
    cfg = net.config
    assert (cfg.arch, cfg.embed_scale, cfg.attn_scale, cfg.residual_scale, cfg.logit_scale) == \
        ("granite", 12.0, 0.1, 0.22, 8.0)


@pytest.mark.parametrize("name", NAMES)
def test_f32_logits_and_decode_match_transformers(granite, name):
    net, hf, _ = granite(name)
    ref = hf_logits(hf, PROMPT)                                              # (32, vocab)
    net.reset()
    assert rel_err(net.forward(PROMPT, 0), ref) < 1e-3
    net.reset()
    rows = [net.forward(PROMPT[:16], 0)] + [net.forward(PROMPT[p:p + 1], p) for p in range(16, 32)]
    assert rel_err(np.concatenate(rows), ref) < 1e-3                        # KV cache, T = 1 path


@pytest.mark.parametrize("name", NAMES)
def test_greedy_32_tokens_match_transformers(granite, name):
    net, hf, _ = granite(name)
    net.reset()
    got = []
    generate(net, Sampler(SamplerParams(temp=0.0)), PROMPT[:8].tolist(), 32, on_token=got.append)
    assert got == greedy_hf(hf, PROMPT[:8], 32)


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("name", NAMES)
def test_quantized_logits(granite, name, dtype):
    net, hf, _ = granite(name, dtype)
    net.reset()
    ours = net.forward(PROMPT, 0)                                            # (32, vocab)
    assert rel_err(ours, hf_logits(rounded_reference(hf, dtype), PROMPT)) < TOL_VS_ROUNDED[dtype]
    assert rel_err(ours, hf_logits(hf, PROMPT)) < TOL_VS_ORIGINAL[dtype]


def write_granite_gguf(hf, path):
    """The transformers model as llama.cpp's convert_hf_to_gguf.py GraniteModel writes it (F32):
    gguf-py's tensor names, attn_q / attn_k permuted (LlamaModel.modify_tensors), the scales."""
    import gguf
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "granite")
    gguf_metadata(w, cfg, "granite")                 # what every tiny GGUF carries
    w.add_embedding_scale(cfg.embedding_multiplier)
    w.add_attention_scale(cfg.attention_multiplier)
    w.add_residual_scale(cfg.residual_multiplier)
    w.add_logit_scale(cfg.logits_scaling)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GRANITE, cfg.num_hidden_layers)
    heads = {".attn_q.": cfg.num_attention_heads, ".attn_k.": cfg.num_key_value_heads}
    for name, p in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        value = p.detach().float().numpy().copy()
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        for part, n in heads.items():
            value = llamacpp_permute(value, n) if part in gname else value
        w.add_tensor(gname, value.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("name", NAMES)
def test_gguf_of_a_tiny_granite_matches_transformers(granite, tmp_path, name):
    _, hf, _ = granite(name)
    path = write_granite_gguf(hf, tmp_path / f"{name}.gguf")
    net = Model(open_flash(convert(path, tmp_path / "m", "f32")), n_threads=2, n_ctx=128)
    assert (net.config.arch, net.config.residual_scale, net.config.logit_scale) == \
        ("granite", float(np.float32(0.22)), 8.0)                          # GGUF floats are f32
    assert rel_err(net.forward(PROMPT, 0), hf_logits(hf, PROMPT)) < 1e-3
    net.reset()
    got = []
    generate(net, Sampler(SamplerParams(temp=0.0)), PROMPT[:8].tolist(), 24, on_token=got.append)
    assert got == greedy_hf(hf, PROMPT[:8], 24)


def test_mlp_bias_is_refused_in_one_line(granite, tmp_path):
    import json
    import shutil
    _, _, folder = granite("granite")
    src = tmp_path / "src"
    shutil.copytree(folder, src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "mlp_bias": True}))
    with pytest.raises(SourceError, match="mlp_bias=True is unsupported"):
        convert(src, tmp_path / "m", "f32")
