"""Llama and the architectures that differ from it only in config values: Mistral (a sliding
window on every layer). Also the Hugging Face table parts the other llama-likes share (Qwen,
Phi-3, the mixtures of experts, Granite): pre-RMSNorm, q / k / v / o projections, a gated FFN.

Llama GGUF files (llama.cpp's convert_hf_to_gguf) store attn_q / attn_k rows permuted for
interleaved RoPE: gguf_permuted_qk undoes it at conversion. A "llama" GGUF may hold experts
(Mixtral converted by llama.cpp): llama.cpp renormalises their top-k weights (gguf_norm_topk).
"""
from __future__ import annotations

from typing import Mapping

from flashllm.model.archs.base import register
from flashllm.model.archs.hf import every_layer_window, rope_model
from flashllm.model.config import ModelConfig

LLAMA_ATTENTION = (
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    ("model.layers.{i}.self_attn.q_proj.{wb}", "blk.{i}.attn_q.{wb}"),
    ("model.layers.{i}.self_attn.k_proj.{wb}", "blk.{i}.attn_k.{wb}"),
    ("model.layers.{i}.self_attn.v_proj.{wb}", "blk.{i}.attn_v.{wb}"),
    ("model.layers.{i}.self_attn.o_proj.{wb}", "blk.{i}.attn_output.{wb}"),
    ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight"),
)
LLAMA_FFN = (
    ("model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight"),
)
LLAMA_TABLE = LLAMA_ATTENTION + LLAMA_FFN
QK_NORM = (
    ("model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight"),
    ("model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight"),
)
ROTARY_BUFFERS = ("model.rotary_emb.inv_freq", "model.layers.{i}.self_attn.rotary_emb.inv_freq")


@register("llama", ["LlamaForCausalLM"], LLAMA_TABLE, ROTARY_BUFFERS, gguf_archs=["llama"],
          gguf_permuted_qk=True, gguf_norm_topk=True)
def llama_config(cfg: Mapping) -> ModelConfig:
    bias = bool(cfg.get("attention_bias", False))
    return rope_model(cfg, "llama", bias, bias)


@register("mistral", ["MistralForCausalLM"], LLAMA_TABLE, ROTARY_BUFFERS)
def mistral_config(cfg: Mapping) -> ModelConfig:
    """Mistral = llama without biases; every layer attends through sliding_window when the
    config has one (Mistral-7B v0.1: 4096)."""
    return rope_model(cfg, "mistral", False, False, **every_layer_window(cfg, "MistralForCausalLM"))
