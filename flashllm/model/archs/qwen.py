"""Qwen2 (biases on q / k / v) and Qwen3 (QK-norm per head, head_dim from the config). Their
mixtures of experts are in moe.py. use_sliding_window is off in released models and refused."""
from __future__ import annotations

from typing import Mapping

from flashllm.model.archs.base import register
from flashllm.model.archs.hf import refuse_sliding, rope_model
from flashllm.model.archs.llama import LLAMA_TABLE, QK_NORM, ROTARY_BUFFERS
from flashllm.model.config import ModelConfig


@register("qwen2", ["Qwen2ForCausalLM"], LLAMA_TABLE, ROTARY_BUFFERS, gguf_archs=["qwen2"])
def qwen2_config(cfg: Mapping) -> ModelConfig:
    """Qwen2: biases on q/k/v only."""
    refuse_sliding(cfg, "Qwen2ForCausalLM")
    return rope_model(cfg, "qwen2", True, False)


@register("qwen3", ["Qwen3ForCausalLM"], LLAMA_TABLE + QK_NORM, ROTARY_BUFFERS, gguf_archs=["qwen3"])
def qwen3_config(cfg: Mapping) -> ModelConfig:
    """Qwen3: QK-norm, head_dim from the config (not d_model / n_heads), no q/k/v bias unless
    attention_bias."""
    refuse_sliding(cfg, "Qwen3ForCausalLM")
    bias = bool(cfg.get("attention_bias", False))
    return rope_model(cfg, "qwen3", bias, bias, qk_norm=True)
