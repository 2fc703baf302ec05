"""GGUF sources against transformers: each tiny checkpoint of hf_tiny.py written as llama.cpp
would write it (gguf_tiny.py), converted at f32, must give transformers' logits (max relative
error < 1e-3, as the safetensors path in test_parity_hf.py) and its greedy tokens."""
from __future__ import annotations

import copy

import pytest

from gguf_tiny import write_gguf
from test_parity_hf import PROMPT, hf_logits, rel_err

from flashllm.convert.convert import convert
from flashllm.format.reader import open_flash
from flashllm.generation.generate import generate
from flashllm.generation.sampler import Sampler, SamplerParams
from flashllm.runtime.model import Model

# tiny model name -> GGUF architecture
CASES = {"llama": "llama", "llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma3": "gemma3",
         "gemma3_softcap": "gemma3"}


def gguf_semantics(hf, arch: str):
    """The transformers model as its GGUF means it: a gemma3 GGUF carries no
    query_pre_attn_scalar, llama.cpp scales scores by 1/sqrt(head_dim) (the value of every
    released Gemma 3 but the 27B, which it special-cases); the tiny gemma3 has 20 != 24."""
    if arch != "gemma3" or hf.config.query_pre_attn_scalar == hf.config.head_dim:
        return hf
    ref = copy.deepcopy(hf)
    for layer in ref.model.layers:
        layer.self_attn.scaling = hf.config.head_dim ** -0.5
    return ref


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_of_a_tiny_model_matches_transformers(hf_tiny, tmp_path, name):
    import torch
    _, hf = hf_tiny(name)
    hf = gguf_semantics(hf, CASES[name])
    path = write_gguf(hf, tmp_path / f"{name}.gguf", CASES[name])
    net = Model(open_flash(convert(path, tmp_path / "m", "f32")), n_threads=2, n_ctx=128)
    assert net.config.arch == CASES[name]
    err = rel_err(net.forward(PROMPT, 0), hf_logits(hf, PROMPT))
    print(f"{name} via GGUF: logits vs transformers {err:.2e}")
    assert err < 1e-3
    net.reset()
    prompt = PROMPT[:8]
    with torch.no_grad():
        seq = hf.generate(torch.as_tensor(prompt).reshape(1, -1), do_sample=False,
                          max_new_tokens=24, min_new_tokens=24, pad_token_id=0)
    got = []
    generate(net, Sampler(SamplerParams(temp=0.0)), prompt.tolist(), 24, on_token=got.append)
    assert got == seq[0, len(prompt):].tolist()
