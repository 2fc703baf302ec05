"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against transformers: from GGUFs in
llama.cpp's `*_exps` layout (tests/moe_gguf.py) made from the tiny checkpoints' weights, and with
the experts streamed from flash under a --dram-budget (the same math: the same logits).

The HF checkpoints themselves are in tests/test_parity_hf.py (TINY includes hf_tiny.TINY_MOE)."""
from __future__ import annotations

import numpy as np
import pytest

from hf_tiny import TINY_MOE, VOCAB
from moe_gguf import write_moe_gguf

from flashllm.convert.convert import convert
from flashllm.format.reader import open_flash
from flashllm.generation.generate import generate
from flashllm.generation.sampler import Sampler, SamplerParams
from flashllm.runtime.model import Model

PROMPT = np.random.default_rng(7).integers(3, VOCAB, size=24).astype(np.int64)   # (24,)
MOE = list(TINY_MOE)


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def hf_logits(model, ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.as_tensor(ids).reshape(1, -1)).logits[0].float().numpy()   # (T, vocab)


def hf_greedy(model, prompt, n: int) -> list[int]:
    """n greedy tokens of transformers, EOS neither stopping nor masked (generate() here runs on)."""
    import torch
    eos, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        with torch.no_grad():
            seq = model.generate(torch.as_tensor(prompt).reshape(1, -1), do_sample=False,
                                 max_new_tokens=n, pad_token_id=0)
    finally:
        model.generation_config.eos_token_id = eos
    return seq[0, len(prompt):].tolist()


def with_experts(model, written: dict):
    """A copy of the transformers model whose experts hold the values the GGUF stores."""
    import copy
    import torch
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            experts = layer.mlp.experts
            gate_up = np.concatenate([written[i, "gate"], written[i, "up"]], axis=1)  # (E, 2ff, d)
            experts.gate_up_proj.copy_(torch.from_numpy(gate_up))
            experts.down_proj.copy_(torch.from_numpy(written[i, "down"]))            # (E, d, ff)
    return ref.eval()


@pytest.mark.parametrize("name", MOE)
def test_gguf_exps_layout_matches_transformers(hf_tiny, tmp_path, name):
    """gate_exps Q8_0, up_exps Q4_0, down_exps F16 (3-D, as llama.cpp writes them), converted at
    f32: transformers with those experts is the reference."""
    folder, hf = hf_tiny(name)
    written = write_moe_gguf(folder, tmp_path / "m.gguf", quantize_experts=True)
    ref = with_experts(hf, written)
    net = Model(open_flash(convert(tmp_path / "m.gguf", tmp_path / "m", "f32")), n_threads=2,
                n_ctx=96, exact=True)
    err = rel_err(net.forward(PROMPT, 0), hf_logits(ref, PROMPT))
    print(f"{name}: GGUF *_exps -> flashllm f32 vs transformers {err:.2e}")
    assert err < 1e-3
    net.reset()
    got = []
    generate(net, Sampler(SamplerParams(temp=0.0)), PROMPT[:6].tolist(), 24, on_token=got.append)
    assert got == hf_greedy(ref, PROMPT[:6], 24)
