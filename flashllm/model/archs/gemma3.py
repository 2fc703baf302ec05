"""Gemma 3's text model: its tensor table and its ModelConfig fields, from config.json and from
a GGUF.

What sets it apart, all data the one forward pass reads (runtime/model.py):
- GeGLU: gelu with the tanh approximation (`gelu_pytorch_tanh`) gating the up projection;
- RMSNorm scaling by (1 + w): the +1 is folded into w at conversion (Arch.norm_shift; exact for
  the f32 norms flashllm stores, and what transformers computes too: `1.0 + weight.float()`);
  llama.cpp's converter already folded it into GGUF files;
- sandwich norms: post_attention_norm and post_ffw_norm on each block's outputs, and QK-norm;
- token embeddings times sqrt(d_model) (transformers casts the scale to the model dtype, so an
  f32 model uses float32(sqrt(d)); llama.cpp multiplies by sqrtf(n_embd), the same number);
- attention scores times query_pre_attn_scalar^-0.5;
- sliding-window layers (all but every sliding_window_pattern-th, or config.json's layer_types)
  with their own RoPE base (rope_local_base_freq, 10000) and no rope scaling; the global layers
  use rope_theta and its scaling (linear in the 4B+ models);
- final logit softcapping when the config has it (released Gemma 3 models do not);
  attention logit softcapping (Gemma 2) is refused.
"""
from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from flashllm.errors import SourceError
from flashllm.model.config import ModelConfig
from flashllm.model.archs.base import register
from flashllm.model.archs.hf import need, rope_model
from flashllm.model.archs.llama import ROTARY_BUFFERS
from flashllm.model.rope import hf_rope

WHERE = "Gemma3ForCausalLM"
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")      # transformers' names of the tanh approximation


def embed_scale(d_model: int) -> float:
    return float(np.float32(math.sqrt(d_model)))


def _sliding_layers(cfg: Mapping, n_layers: int) -> tuple[int, tuple[int, ...]]:
    window = int(cfg.get("sliding_window") or 0)
    types = cfg.get("layer_types")
    if not types:
        n = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        types = ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(n_layers)]
    if len(types) != n_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise SourceError(f"{WHERE}: layer_types {types!r} is not one of sliding_attention / "
                          f"full_attention per layer")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return (window, sliding) if window and sliding else (0, ())


# Gemma's turn markers, for a file that carries no template (Gemma's GGUFs often do not): Gemma
# has no system turn, so the system prompt opens the first user turn.
GEMMA_TURNS = ("{{ bos_token }}{% set ns = namespace(system='') %}{% for message in messages %}"
               "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\n\n' %}"
               "{% else %}{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user')"
               " + '\n' + ns.system + message['content'] + '<end_of_turn>\n' }}"
               "{% set ns.system = '' %}{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")

GEMMA3_TABLE = (
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight"),
    ("model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight"),
    ("model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight"),
    ("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight"),
    ("model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight"),
    ("model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.post_attention_norm.weight"),
    ("model.layers.{i}.pre_feedforward_layernorm.weight", "blk.{i}.ffn_norm.weight"),
    ("model.layers.{i}.post_feedforward_layernorm.weight", "blk.{i}.post_ffw_norm.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight"),
)


def gemma3_gguf_fields(meta: Mapping, cfg: ModelConfig) -> dict:
    """The fields llama.cpp fixes for GGUF arch gemma3 (src/models/gemma3.cpp): GeGLU, sandwich
    norms, sqrt(n_embd) embedding scale, 1/sqrt(head_dim) attention scale (n_embd / n_head for
    the 62-layer 27B), the sliding layers' RoPE base (rope.freq_base_swa, else 10000), softcap."""
    per_head = cfg.d_model / cfg.n_heads if cfg.n_layers == 62 else cfg.head_dim
    local = float(meta.get("gemma3.rope.freq_base_swa") or 10000.0)
    return dict(act="gelu_tanh", sandwich_norm=True, embed_scale=embed_scale(cfg.d_model),
                attn_scale=per_head ** -0.5, rope_local_theta=local if cfg.sliding_layers else 0.0,
                final_softcap=float(meta.get("gemma3.final_logit_softcapping") or 0.0))


@register("gemma3", [WHERE], GEMMA3_TABLE, ROTARY_BUFFERS, gguf_archs=["gemma3"],
          gguf_swa_pattern=6, norm_shift=1.0, gguf_fields=gemma3_gguf_fields,
          chat_turns=("Gemma", GEMMA_TURNS))
def gemma3_hf_config(cfg: Mapping) -> ModelConfig:
    """ModelConfig of a Gemma3ForCausalLM config.json (transformers 4 or 5 keys)."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GELU_TANH:
        raise SourceError(f"{WHERE}: hidden_activation {act!r} is unsupported (only gelu_pytorch_tanh)")
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if cfg.get(key):
            raise SourceError(f"{WHERE}: {key}={cfg[key]!r} is unsupported")
    d_model, n_layers = int(need(cfg, "hidden_size", WHERE)), int(need(cfg, "num_hidden_layers", WHERE))
    head_dim = int(cfg.get("head_dim") or 256)
    theta, factors = hf_rope(cfg, head_dim, WHERE, "full_attention", default_theta=1e6)
    if isinstance((cfg.get("rope_parameters") or {}).get("sliding_attention"), Mapping):
        local, local_factors = hf_rope(cfg, head_dim, WHERE, "sliding_attention")
        if local_factors:
            raise SourceError(f"{WHERE}: rope scaling on the sliding-window layers is unsupported")
    else:
        local = float(cfg.get("rope_local_base_freq") or 10000.0)
    window, sliding = _sliding_layers(cfg, n_layers)
    softcap = cfg.get("final_logit_softcapping")
    return rope_model(
        {**cfg, "head_dim": head_dim}, "gemma3", False, False, act="gelu_tanh",
        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)), qk_norm=True, sandwich_norm=True,
        rope_theta=theta, rope_freq_factors=factors, rope_local_theta=local if sliding else 0.0,
        sliding_window=window, sliding_layers=sliding, embed_scale=embed_scale(d_model),
        attn_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        final_softcap=float(softcap or 0.0))

