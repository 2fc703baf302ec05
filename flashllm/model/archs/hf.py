"""Hugging Face config.json -> ModelConfig: the helpers every architecture's reader shares
(each file of model/archs/ registers one reader per architecture)."""
from __future__ import annotations

from typing import Mapping

from flashllm.errors import SourceError
from flashllm.model.config import ModelConfig
from flashllm.model.rope import hf_rope


COUNTS = frozenset({"hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
                    "intermediate_size", "max_position_embeddings", "num_experts_per_tok"})


def need(cfg: Mapping, key: str, where: str):
    """config.json's key; one SourceError line when it is absent, or (COUNTS) not a positive
    integer (a 0 there would divide by zero below)."""
    if cfg.get(key) is None:
        raise SourceError(f"{where}: config.json has no {key!r}")
    value = cfg[key]
    if key in COUNTS and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise SourceError(f"{where}: config.json's {key}={value!r} must be a positive integer")
    return value


def eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def silu_act(cfg: Mapping, where: str) -> str:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise SourceError(f"{where}: hidden_act {act!r} is unsupported (only silu)")
    return "silu"


def rope_model(cfg: Mapping, name: str, qkv_bias: bool, out_bias: bool, act: str | None = None,
               **fields) -> ModelConfig:
    """The shared config of llama-like models (RMSNorm, GLU FFN, RoPE): act, else hidden_act
    (only silu); `fields` set or override ModelConfig fields."""
    where = name
    d_model = int(need(cfg, "hidden_size", where))
    n_heads = int(need(cfg, "num_attention_heads", where))
    if cfg.get("mlp_bias"):
        raise SourceError(f"{where}: mlp_bias=True is unsupported")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0 or \
            (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0) != 1.0:
        raise SourceError(f"{where}: partial_rotary_factor is unsupported")
    head_dim = int(cfg.get("head_dim") or d_model // n_heads)
    theta, factors = hf_rope(cfg, head_dim, where)
    base = dict(
        arch=name, vocab_size=int(need(cfg, "vocab_size", where)), d_model=d_model,
        n_layers=int(need(cfg, "num_hidden_layers", where)), n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        n_ff=int(fields.pop("n_ff", None) or need(cfg, "intermediate_size", where)),
        context_length=int(need(cfg, "max_position_embeddings", where)),
        norm="rms", norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), act=act or silu_act(cfg, where), glu=True,
        pos="rope", rope_theta=theta, rope_freq_factors=factors, tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attn_qkv_bias=qkv_bias, attn_out_bias=out_bias,
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids(cfg.get("eos_token_id")))
    return ModelConfig(**{**base, **fields}).validate()


def every_layer_window(cfg: Mapping, where: str) -> dict:
    """sliding_window and sliding_layers for a model whose every layer attends through
    config.json's sliding_window (none when it is null)."""
    window = int(cfg.get("sliding_window") or 0)
    layers = tuple(range(int(need(cfg, "num_hidden_layers", where)))) if window else ()
    return dict(sliding_window=window, sliding_layers=layers)


def refuse_sliding(cfg: Mapping, where: str) -> None:
    """Qwen's use_sliding_window: off in released models, refused here."""
    if cfg.get("use_sliding_window"):
        raise SourceError(f"{where}: use_sliding_window=True is unsupported")
