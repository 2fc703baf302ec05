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
    """A copy of the transformers model whose experts hold the values the GGUF stores, and no
    sliding window: a GGUF carries none for these architectures (llama.cpp ignores Mixtral's)."""
    import copy
    import torch
    ref = copy.deepcopy(model)
    if ref.config.model_type == "mixtral":
        ref.config.sliding_window = None
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


# ---- experts streamed from flash ---------------------------------------------------------------

def streamed_model(path, experts_cached: int, staging_rows: int = 64, naive: bool = False):
    """Model over the folder at path whose FFN is an ExpertFlashFfn caching `experts_cached`
    experts per layer (the shared expert, if any, resident on top) and streaming the rest through
    a staging buffer of staging_rows bundles."""
    import dataclasses
    from flashllm.ffi.reader import Reader
    from flashllm.format.manifest import read_manifest
    from flashllm.runtime.budget import parse_budget, plan_budget
    from flashllm.runtime.expert_ffn import ExpertFlashFfn
    flash = open_flash(path)
    cfg = flash.config
    plan = dataclasses.replace(plan_budget(read_manifest(path), parse_budget(str(1 << 40)), 96, process=0),
                               capacity=experts_cached * cfg.n_ff + cfg.n_ff_shared,
                               staging_rows=staging_rows)
    ffn = ExpertFlashFfn(flash, plan, Reader(flash.ffn.file, n_threads=2), n_threads=2,
                         naive=naive, exact=True)
    return Model(flash, n_threads=2, n_ctx=96, ffn=ffn, exact=True), ffn


@pytest.mark.parametrize("cached", [0, 1, 3])
@pytest.mark.parametrize("name", MOE)
def test_streamed_experts_match_transformers(flash_moe, name, cached):
    """Prefill 12 tokens, decode 12 one by one (the read-ahead guesses the next layer's experts
    then), with 0, 1 or 3 experts cached per layer: against transformers, < 1e-3."""
    path, hf = flash_moe(name)
    net, ffn = streamed_model(path, cached, staging_rows=7 if cached == 0 else 64)
    rows = [net.forward(PROMPT[:12], 0)] + [net.forward(PROMPT[p:p + 1], p) for p in range(12, 24)]
    err = rel_err(np.concatenate(rows), hf_logits(hf, PROMPT))
    stats = ffn.stats()["decode_mean"]
    ffn.close()
    print(f"{name}, {cached} cached: {err:.2e}; per decode token {stats['experts']:.1f} experts, "
          f"{stats['expert_hits']:.1f} cached, {stats['expert_reads']:.1f} read, "
          f"{stats['prefetched']:.1f} prefetched, {stats['bytes_read']:.0f} bytes")
    assert err < 1e-3
    assert stats["bytes_read"] > 0


@pytest.mark.parametrize("name", ["qwen2_moe", "olmoe"])
def test_streamed_greedy_matches_transformers(flash_moe, name):
    path, hf = flash_moe(name)
    net, ffn = streamed_model(path, 2)
    got = []
    generate(net, Sampler(SamplerParams(temp=0.0)), PROMPT[:6].tolist(), 24, on_token=got.append)
    ffn.close()
    assert got == hf_greedy(hf, PROMPT[:6], 24)


def test_reads_are_the_routed_experts(flash_moe):
    """Nothing cached (--naive): a decode token reads exactly its routed experts' bundles, one
    read each (counted by the reader, page padding aside), and nothing is prefetched."""
    path, _ = flash_moe("olmoe")
    net, ffn = streamed_model(path, 0, staging_rows=4096, naive=True)
    net.forward(PROMPT[:8], 0, last_only=True)                        # a prefill
    net.forward(PROMPT[8:9], 8)                                        # one decode token
    cfg, f = open_flash(path).config, open_flash(path).ffn
    t = ffn.stats()["decode_mean"]
    ffn.close()
    k = cfg.n_experts_used
    assert t["experts"] == k * cfg.n_layers and t["prefetched"] == 0 and t["expert_hits"] == 0
    assert t["bytes_requested"] == k * cfg.n_layers * cfg.n_ff * f.stride
    assert t["reads"] == k * cfg.n_layers


@pytest.fixture(scope="module")
def flash_moe(hf_tiny, tmp_path_factory):
    """name -> (converted f32 folder, transformers model), converted once per module."""
    done = {}

    def get(name: str):
        if name not in done:
            folder, hf = hf_tiny(name)
            done[name] = (convert(folder, tmp_path_factory.mktemp(name) / "m", "f32"), hf)
        return done[name]
    return get
