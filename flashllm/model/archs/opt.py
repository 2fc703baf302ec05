"""OPT: pre-LayerNorm with biases everywhere, a ReLU FFN (fc1 = up, fc2 = down), learned
positions offset by 2, and word_embed_proj_dim (project_in / project_out) where it is not
hidden_size. Some checkpoints omit the leading "model." of their names ({m})."""
from __future__ import annotations

from typing import Mapping

from flashllm.errors import SourceError
from flashllm.model.archs.base import register
from flashllm.model.archs.hf import eos_ids, need
from flashllm.model.config import ModelConfig

OPT_TABLE = (
    ("{m}decoder.embed_tokens.weight", "token_embd.weight"),
    ("{m}decoder.embed_positions.weight", "position_embd.weight"),
    ("{m}decoder.project_in.weight", "proj_in.weight"),
    ("{m}decoder.project_out.weight", "proj_out.weight"),
    ("{m}decoder.final_layer_norm.{wb}", "output_norm.{wb}"),
    ("lm_head.weight", "output.weight"),
    ("{m}decoder.layers.{i}.self_attn_layer_norm.{wb}", "blk.{i}.attn_norm.{wb}"),
    ("{m}decoder.layers.{i}.self_attn.q_proj.{wb}", "blk.{i}.attn_q.{wb}"),
    ("{m}decoder.layers.{i}.self_attn.k_proj.{wb}", "blk.{i}.attn_k.{wb}"),
    ("{m}decoder.layers.{i}.self_attn.v_proj.{wb}", "blk.{i}.attn_v.{wb}"),
    ("{m}decoder.layers.{i}.self_attn.out_proj.{wb}", "blk.{i}.attn_output.{wb}"),
    ("{m}decoder.layers.{i}.final_layer_norm.{wb}", "blk.{i}.ffn_norm.{wb}"),
    ("{m}decoder.layers.{i}.fc1.{wb}", "blk.{i}.ffn_up.{wb}"),
    ("{m}decoder.layers.{i}.fc2.{wb}", "blk.{i}.ffn_down.{wb}"),
)


def _refuse(cfg: Mapping, where: str) -> None:
    if not cfg.get("do_layer_norm_before", True):
        raise SourceError(f"{where}: do_layer_norm_before=False (post-LayerNorm OPT-350m) is unsupported")
    if cfg.get("_remove_final_layer_norm") or not cfg.get("layer_norm_elementwise_affine", True):
        raise SourceError(f"{where}: OPT without final/affine layer norms is unsupported")
    act = cfg.get("activation_function", "relu")
    if act != "relu":
        raise SourceError(f"{where}: activation_function {act!r} is unsupported (only relu)")


@register("opt", ["OPTForCausalLM"], OPT_TABLE)
def opt_config(cfg: Mapping) -> ModelConfig:
    where = "OPTForCausalLM"
    _refuse(cfg, where)
    d_model = int(need(cfg, "hidden_size", where))
    n_heads = int(need(cfg, "num_attention_heads", where))
    d_embed = int(cfg.get("word_embed_proj_dim") or d_model)
    bias = bool(cfg.get("enable_bias", True))
    return ModelConfig(
        arch="opt", vocab_size=int(need(cfg, "vocab_size", where)), d_model=d_model,
        n_layers=int(need(cfg, "num_hidden_layers", where)), n_heads=n_heads, n_kv_heads=n_heads,
        head_dim=d_model // n_heads, n_ff=int(need(cfg, "ffn_dim", where)),
        context_length=int(need(cfg, "max_position_embeddings", where)),
        norm="layer", norm_eps=1e-5, act="relu", glu=False, pos="learned", pos_offset=2,
        d_embed=d_embed if d_embed != d_model else 0,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attn_qkv_bias=bias, attn_out_bias=bias, ffn_bias=bias,
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids(cfg.get("eos_token_id")),
    ).validate()
