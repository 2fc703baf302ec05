"""Mixture-of-experts architectures as data: their Hugging Face tensor tables, the MoE and
QK-norm fields of a ModelConfig read from config.json or GGUF metadata, and the canonical tensors
an MoE layer holds (docs/ARCHITECTURE.md). flashllm/model/arch.py registers them.

An MoE layer's FFN is a router `ffn_gate_inp` (n_experts, d_model), resident, and n_experts
gated experts of n_ff neurons each, `ffn_{gate,up,down}_exps` (n_experts, n_ff, d_model) /
(n_experts, d_model, n_ff) as llama.cpp stores them; Hugging Face checkpoints hold one tensor per
expert, which the `{e}` of a pattern numbers. Qwen2-MoE adds a shared expert (`*_shexp`, n_ff_shared
neurons) that every token runs, scaled by sigmoid(ffn_gate_inp_shexp · h).
"""
from __future__ import annotations

from typing import Mapping

from flashllm.errors import SourceError
from flashllm.model.hf_config import need

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

SHARED_GATE = "ffn_gate_inp_shexp.weight"     # HF stores it (1, d_model), canonical is (d_model,)


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


def gguf_moe_fields(meta: Mapping, a: str, names, norm_default: bool) -> dict:
    """The MoE fields from GGUF metadata `{a}.expert_*` ({} for a dense model); norm_topk from
    `{a}.expert_weights_norm` when written, else what llama.cpp does for the architecture."""
    n_experts = int(meta.get(f"{a}.expert_count") or 0)
    if not n_experts:
        return {}
    gating = meta.get(f"{a}.expert_gating_func")
    if gating not in (None, 1):
        raise SourceError(f"GGUF {a}.expert_gating_func={gating}: only softmax routing (1) is "
                          f"supported")
    if meta.get(f"{a}.expert_weights_scale") not in (None, 1.0):
        raise SourceError(f"GGUF {a}.expert_weights_scale="
                          f"{meta[f'{a}.expert_weights_scale']}: scaled expert weights are unsupported")
    used = meta.get(f"{a}.expert_used_count")
    n_ff = meta.get(f"{a}.expert_feed_forward_length") or meta.get(f"{a}.feed_forward_length")
    if used is None or n_ff is None:
        raise SourceError(f"GGUF metadata has {a}.expert_count but no {a}.expert_used_count or "
                          f"feed-forward length")
    shared = int(meta.get(f"{a}.expert_shared_feed_forward_length") or 0) \
        if "blk.0.ffn_up_shexp.weight" in names else 0
    norm = meta.get(f"{a}.expert_weights_norm")
    return dict(n_experts=n_experts, n_experts_used=int(used), n_ff=int(n_ff), n_ff_shared=shared,
                norm_topk=bool(norm_default if norm is None else norm))


def moe_parts(n_ff_shared: int) -> list[str]:
    """The tensors of an MoE layer's FFN (each blk.N.PART.weight), in order."""
    parts = ["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
    if n_ff_shared:
        parts += ["ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
    return parts

