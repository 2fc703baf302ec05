"""The mixtures of experts: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE — llama-like attention (Qwen's
QK-norm where they have it), their FFN tables, and the MoE fields of config.json (GGUF's are read
by model/archs/gguf.py for every architecture: a "llama" GGUF may hold experts).

An MoE layer's FFN is a router `ffn_gate_inp` (n_experts, d_model), resident, and n_experts
gated experts of n_ff neurons each, `ffn_{gate,up,down}_exps` (n_experts, n_ff, d_model) /
(n_experts, d_model, n_ff) as llama.cpp stores them; Hugging Face checkpoints hold one tensor per
expert, which the `{e}` of a pattern numbers. Qwen2-MoE adds a shared expert (`*_shexp`, n_ff_shared
neurons) that every token runs, scaled by sigmoid(ffn_gate_inp_shexp · h).
"""
from __future__ import annotations

from typing import Mapping

from flashllm.errors import SourceError
from flashllm.model.archs.base import register
from flashllm.model.archs.hf import every_layer_window, need, refuse_sliding, rope_model
from flashllm.model.archs.llama import LLAMA_ATTENTION, QK_NORM, ROTARY_BUFFERS
from flashllm.model.config import ModelConfig

MIXTRAL_FFN_TABLE = (
    ("model.layers.{i}.block_sparse_moe.gate.weight", "blk.{i}.ffn_gate_inp.weight"),
    ("model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight", "blk.{i}.ffn_gate_exps.weight"),
    ("model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight", "blk.{i}.ffn_up_exps.weight"),
    ("model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight", "blk.{i}.ffn_down_exps.weight"),
)

QWEN_MOE_FFN_TABLE = (                        # Qwen2-MoE, Qwen3-MoE, OLMoE
    ("model.layers.{i}.mlp.gate.weight", "blk.{i}.ffn_gate_inp.weight"),
    ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "blk.{i}.ffn_gate_exps.weight"),
    ("model.layers.{i}.mlp.experts.{e}.up_proj.weight", "blk.{i}.ffn_up_exps.weight"),
    ("model.layers.{i}.mlp.experts.{e}.down_proj.weight", "blk.{i}.ffn_down_exps.weight"),
    ("model.layers.{i}.mlp.shared_expert.gate_proj.weight", "blk.{i}.ffn_gate_shexp.weight"),
    ("model.layers.{i}.mlp.shared_expert.up_proj.weight", "blk.{i}.ffn_up_shexp.weight"),
    ("model.layers.{i}.mlp.shared_expert.down_proj.weight", "blk.{i}.ffn_down_shexp.weight"),
    ("model.layers.{i}.mlp.shared_expert_gate.weight", "blk.{i}.ffn_gate_inp_shexp.weight"),
)


def hf_moe_fields(cfg: Mapping, where: str, ff_key: str, norm_topk=None) -> dict:
    """The ModelConfig fields of an HF MoE config.json: n_experts (num_experts, or
    num_local_experts as Mixtral and transformers 5's Qwen3-MoE write it), n_ff (the
    expert's, from ff_key), top-k, norm_topk (config's norm_topk_prob unless given), the shared
    expert. Every layer must be an MoE layer (decoder_sparse_step 1, no mlp_only_layers)."""
    if int(cfg.get("decoder_sparse_step") or 1) != 1 or cfg.get("mlp_only_layers"):
        raise SourceError(f"{where}: dense layers among the MoE layers (decoder_sparse_step / "
                          f"mlp_only_layers) are unsupported")
    key = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    n_experts = int(need(cfg, key, where))
    fields = dict(n_experts=n_experts, n_experts_used=int(need(cfg, "num_experts_per_tok", where)),
                  n_ff=int(need(cfg, ff_key, where)),
                  norm_topk=bool(cfg.get("norm_topk_prob", False) if norm_topk is None else norm_topk),
                  n_ff_shared=int(cfg.get("shared_expert_intermediate_size") or 0))
    if fields["n_experts_used"] > n_experts or fields["n_experts_used"] < 1:
        raise SourceError(f"{where}: num_experts_per_tok={fields['n_experts_used']} with "
                          f"{n_experts} experts")
    return fields


MIXTRAL_TABLE = LLAMA_ATTENTION + MIXTRAL_FFN_TABLE
QWEN_MOE_TABLE = LLAMA_ATTENTION + QK_NORM + QWEN_MOE_FFN_TABLE


@register("mixtral", ["MixtralForCausalLM"], MIXTRAL_TABLE, ROTARY_BUFFERS)
def mixtral_config(cfg: Mapping) -> ModelConfig:
    """Mixtral: Mistral attention, top-k experts always renormalised (MixtralTopKRouter)."""
    moe = hf_moe_fields(cfg, "MixtralForCausalLM", "intermediate_size", True)
    return rope_model(cfg, "mixtral", False, False, **moe,
                      **every_layer_window(cfg, "MixtralForCausalLM"))


@register("qwen2moe", ["Qwen2MoeForCausalLM"], QWEN_MOE_TABLE, ROTARY_BUFFERS,
          gguf_archs=["qwen2moe"])
def qwen2moe_config(cfg: Mapping) -> ModelConfig:
    """Qwen2-MoE: Qwen2 attention (q/k/v biases: qkv_bias), a shared expert with a sigmoid gate."""
    where = "Qwen2MoeForCausalLM"
    refuse_sliding(cfg, where)
    moe = hf_moe_fields(cfg, where, "moe_intermediate_size")
    return rope_model(cfg, "qwen2moe", bool(cfg.get("qkv_bias", True)), False, **moe)


@register("qwen3moe", ["Qwen3MoeForCausalLM"], QWEN_MOE_TABLE, ROTARY_BUFFERS,
          gguf_archs=["qwen3moe"], gguf_norm_topk=True)
def qwen3moe_config(cfg: Mapping) -> ModelConfig:
    """Qwen3-MoE: Qwen3's per-head QK-norm, no shared expert."""
    where = "Qwen3MoeForCausalLM"
    refuse_sliding(cfg, where)
    moe = hf_moe_fields(cfg, where, "moe_intermediate_size")
    bias = bool(cfg.get("attention_bias", False))
    return rope_model(cfg, "qwen3moe", bias, bias, qk_norm=True, **moe)


@register("olmoe", ["OlmoeForCausalLM"], QWEN_MOE_TABLE, ROTARY_BUFFERS, gguf_archs=["olmoe"],
          gguf_qk_norm_full=True)
def olmoe_config(cfg: Mapping) -> ModelConfig:
    """OLMoE: QK-norm over the whole q / k projection; clip_qkv is refused."""
    where = "OlmoeForCausalLM"
    if cfg.get("clip_qkv") is not None:
        raise SourceError(f"{where}: clip_qkv is unsupported")
    moe = hf_moe_fields(cfg, where, "intermediate_size")
    bias = bool(cfg.get("attention_bias", False))
    return rope_model(cfg, "olmoe", bias, bias, qk_norm=True, qk_norm_full=True, **moe)
