"""Tiny random-initialized Hugging Face checkpoints, built offline, for parity tests.

`make_tiny(name, folder)` writes a transformers model (config.json + model.safetensors in f32) and a
small word-level tokenizer.json into `folder` and returns the folder. Every weight, bias and norm
scale is drawn from a seeded generator, so norms and biases are not the identity/zero they are at
transformers' init (a bug that ignores them would otherwise pass). Callers should first call
`require_transformers()` (or use the `hf_tiny` fixture in conftest.py), which skips the test when
torch or transformers cannot be imported.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

VOCAB = 512
SEED = 1234

# name -> (config class name, config kwargs). Hidden 64-128, 2-3 layers, GQA where the arch has it.
TINY = {
    "llama": ("LlamaConfig", dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                                  rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama_tied": ("LlamaConfig", dict(hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                                       num_attention_heads=3, num_key_value_heads=1,
                                       rope_theta=50000.0, rms_norm_eps=1e-5,
                                       tie_word_embeddings=True)),
    # llama3 rope scaling: with head_dim 16 and original context 64, frequencies fall on both
    # sides of and between the low / high wavelength bounds (16 and 64)
    "llama3": ("LlamaConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   rope_parameters=dict(rope_type="llama3", rope_theta=10000.0,
                                                        factor=8.0, low_freq_factor=1.0,
                                                        high_freq_factor=4.0,
                                                        original_max_position_embeddings=64),
                                   max_position_embeddings=512, rms_norm_eps=1e-5,
                                   tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0,
                                  rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "qwen2_tied": ("Qwen2Config", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                       num_attention_heads=8, num_key_value_heads=2,
                                       rope_theta=1000000.0, rms_norm_eps=1e-6,
                                       tie_word_embeddings=True)),
    # head_dim 40 is not hidden / heads (96 / 4 = 24): the config's own value must be used
    "qwen3": ("Qwen3Config", dict(hidden_size=96, intermediate_size=176, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=40,
                                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    # sliding_window 12 < the 32-token prompt: every layer attends through it
    "phi3": ("Phi3Config", dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                                rms_norm_eps=1e-5, sliding_window=12, max_position_embeddings=256,
                                original_max_position_embeddings=256, tie_word_embeddings=False)),
    # 7 layers: 6 sliding (window 10 < the 32-token prompt, local RoPE base) + layer 5 global
    # (rope_theta with linear scaling x4); head_dim 24 is not 64 / 4; query_pre_attn_scalar 20
    "gemma3": ("Gemma3TextConfig", dict(
        hidden_size=64, intermediate_size=160, num_hidden_layers=7, num_attention_heads=4,
        num_key_value_heads=1, head_dim=24, query_pre_attn_scalar=20, sliding_window=10,
        rope_parameters={"full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1e6),
                         "sliding_attention": dict(rope_type="default", rope_theta=1e4)},
        rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=True)),
    # untied head, final logit softcapping (low enough to bend these logits), both layer kinds
    "gemma3_softcap": ("Gemma3TextConfig", dict(
        hidden_size=96, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, head_dim=40, query_pre_attn_scalar=40, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=30.0, rms_norm_eps=1e-6, max_position_embeddings=256,
        tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1,
                                      rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=None,
                                      tie_word_embeddings=False)),
    # every layer through a window shorter than the tests' 32-token prompt
    "mistral_window": ("MistralConfig", dict(hidden_size=64, intermediate_size=96,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, rope_theta=10000.0,
                                             rms_norm_eps=1e-5, sliding_window=7,
                                             tie_word_embeddings=False)),
    "opt": ("OPTConfig", dict(hidden_size=64, ffn_dim=256, num_hidden_layers=2,
                              num_attention_heads=4, word_embed_proj_dim=64,
                              max_position_embeddings=128, activation_function="relu",
                              do_layer_norm_before=True, enable_bias=True)),
    "opt_proj": ("OPTConfig", dict(hidden_size=96, ffn_dim=256, num_hidden_layers=3,
                                   num_attention_heads=4, word_embed_proj_dim=32,
                                   max_position_embeddings=128, activation_function="relu",
                                   do_layer_norm_before=True, enable_bias=True)),
}

# Mixtures of experts: expert counts, top-k and expert sizes no released model has; top-k >= 2,
# norm_topk_prob on and off (Mixtral always renormalises).
_MOE_ATTN = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY_MOE = {
    "mixtral": ("MixtralConfig", dict(hidden_size=64, intermediate_size=80, num_local_experts=5,
                                      num_experts_per_tok=2, rope_theta=10000.0,
                                      sliding_window=6, **_MOE_ATTN)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(hidden_size=64, intermediate_size=128,
                                         moe_intermediate_size=48, shared_expert_intermediate_size=80,
                                         num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                                         rope_theta=1000000.0, **_MOE_ATTN)),
    "qwen2_moe_norm": ("Qwen2MoeConfig", dict(hidden_size=96, intermediate_size=128,
                                              moe_intermediate_size=40,
                                              shared_expert_intermediate_size=56, num_experts=4,
                                              num_experts_per_tok=2, norm_topk_prob=True,
                                              rope_theta=10000.0, **_MOE_ATTN)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(hidden_size=64, moe_intermediate_size=36, head_dim=24,
                                         num_experts=7, num_experts_per_tok=2, norm_topk_prob=True,
                                         rope_theta=1000000.0, **_MOE_ATTN)),
    "olmoe": ("OlmoeConfig", dict(hidden_size=96, intermediate_size=56, num_experts=5,
                                  num_experts_per_tok=3, norm_topk_prob=False, rope_theta=10000.0,
                                  **_MOE_ATTN)),
    "olmoe_norm": ("OlmoeConfig", dict(hidden_size=64, intermediate_size=72, num_experts=6,
                                       num_experts_per_tok=2, norm_topk_prob=True,
                                       rope_theta=10000.0, **_MOE_ATTN)),
}
TINY.update(TINY_MOE)


def require_transformers():
    """(torch, transformers), or skip the calling test when either cannot be imported."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    return torch, transformers


def build_model(name: str, seed: int = SEED):
    """The tiny transformers model `name` (eval mode, f32) with seeded random parameters."""
    torch, transformers = require_transformers()
    cls_name, kwargs = TINY[name]
    config = getattr(transformers, cls_name)(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
                                             pad_token_id=0, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, torch, seed)
    return model.eval()


def _randomize(model, torch, seed: int) -> None:
    """Redraw every parameter: matrices (and stacked experts' matrices) ~ N(0, 1/sqrt(fan_in))
    (embeddings and lm_head N(0, 1), so logits are far from flat and greedy choices are not near
    ties), norm
    scales ~ 1 + N(0, 0.1), biases ~ N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim == 3:                              # (experts, out, in)
                p.copy_(noise * p.shape[2] ** -0.5)
            elif p.ndim == 2:
                scale = 1.0 if ("embed" in pname or "lm_head" in pname) else p.shape[1] ** -0.5
                p.copy_(noise * scale)
            elif "norm" in pname and pname.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)


def write_tokenizer(folder: Path, vocab: int = VOCAB) -> None:
    """A word-level tokenizer.json over `vocab` tokens: <pad> <s> </s> <unk> w4 w5 ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(4, vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}))


def make_tiny(name: str, folder: Path, seed: int = SEED):
    """Write the tiny model `name` into `folder` (safetensors, f32, with tokenizer); return
    (folder, model) with the model in eval mode for computing reference outputs."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = build_model(name, seed)
    model.save_pretrained(str(folder), safe_serialization=True)
    write_tokenizer(folder)
    return folder, model
