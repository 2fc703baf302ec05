"""Phi-3: fused qkv_proj and gate_up_proj (split into attn_q / attn_k / attn_v and ffn_gate /
ffn_up at conversion, from HF folders and GGUF files alike: llama.cpp keeps them fused as
attn_qkv and a 2·n_ff-row ffn_up, gate first), every layer attending through sliding_window when
the config has one (as transformers does; llama.cpp ignores it). longrope / su scaling (the 128k
models) is refused by model/rope.py and model/archs/gguf.py."""
from __future__ import annotations

from typing import Mapping

from flashllm.model.archs.base import register
from flashllm.model.archs.hf import every_layer_window, rope_model
from flashllm.model.archs.llama import ROTARY_BUFFERS
from flashllm.model.config import ModelConfig

PHI3_TABLE = (
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    ("model.layers.{i}.self_attn.qkv_proj.weight", "blk.{i}.attn_qkv.weight"),
    ("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight"),
    ("model.layers.{i}.mlp.gate_up_proj.weight", "blk.{i}.ffn_up.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight"),
)
PHI3_FUSED = (("attn_qkv", ("attn_q", "attn_k", "attn_v")), ("ffn_up", ("ffn_gate", "ffn_up")))


@register("phi3", ["Phi3ForCausalLM"], PHI3_TABLE, ROTARY_BUFFERS, gguf_archs=["phi3"],
          fused=PHI3_FUSED, gguf_swa_pattern=0)
def phi3_config(cfg: Mapping) -> ModelConfig:
    return rope_model(cfg, "phi3", False, False, **every_layer_window(cfg, "Phi3ForCausalLM"))
