"""Granite (IBM Granite 3.x dense models): llama with four scales, as transformers'
GraniteForCausalLM and llama.cpp's `granite` compute them:

    embeddings      x = embed(tokens) * embedding_multiplier            (ModelConfig.embed_scale)
    attention       scores = q·k * attention_multiplier                 (attn_scale)
    residual        x += attention(x) * residual_multiplier, the same for the FFN   (residual_scale)
    logits          logits = head(norm(x)) / logits_scaling             (logit_scale)

GGUF files (llama.cpp's convert_hf_to_gguf GraniteModel, a LlamaModel: attn_q / attn_k permuted)
carry them as granite.embedding_scale, .attention.scale, .residual_scale and .logit_scale.
"""
from __future__ import annotations

from typing import Mapping

from flashllm.model.archs.base import register
from flashllm.model.archs.hf import rope_model
from flashllm.model.archs.llama import LLAMA_TABLE, ROTARY_BUFFERS
from flashllm.model.config import ModelConfig


def granite_gguf_fields(meta: Mapping, cfg: ModelConfig) -> dict:
    """The four scales from GGUF metadata, absent ones as llama.cpp reads them: 1, and
    head_dim^-0.5 for the attention (attn_scale 0)."""
    def key(name: str, default: float = 1.0) -> float:
        value = meta.get(f"granite.{name}")
        return float(default if value is None else value)
    return dict(embed_scale=key("embedding_scale"), attn_scale=key("attention.scale", 0.0),
                residual_scale=key("residual_scale"), logit_scale=key("logit_scale"))


@register("granite", ["GraniteForCausalLM"], LLAMA_TABLE, ROTARY_BUFFERS, gguf_archs=["granite"],
          gguf_permuted_qk=True, gguf_fields=granite_gguf_fields)
def granite_config(cfg: Mapping) -> ModelConfig:
    """GraniteConfig's multipliers, absent ones as transformers defaults them (1.0 each)."""
    bias = bool(cfg.get("attention_bias", False))
    return rope_model(cfg, "granite", bias, bias,
                      embed_scale=float(cfg.get("embedding_multiplier", 1.0)),
                      attn_scale=float(cfg.get("attention_multiplier", 1.0)),
                      residual_scale=float(cfg.get("residual_multiplier", 1.0)),
                      logit_scale=float(cfg.get("logits_scaling", 1.0)))
