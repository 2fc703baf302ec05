"""GGUF metadata -> ModelConfig (llama.cpp's keys, `{arch}.embedding_length` and the like): the
keys every architecture shares; an Arch's gguf_fields adds what llama.cpp fixes per architecture."""
from __future__ import annotations

from typing import Iterable, Mapping

from flashllm.errors import SourceError
from flashllm.model.archs.base import Arch
from flashllm.model.config import ModelConfig


def gguf_config(arch: Arch, meta: Mapping, tensor_names: Iterable[str], vocab_size: int,
                eos: tuple[int, ...], rope_freqs: tuple[float, ...] = ()) -> ModelConfig:
    """ModelConfig from GGUF metadata (`meta`: key -> value). Tied when output.weight is absent;
    rope_freqs: the values of the file's rope_freqs.weight tensor (llama3 rope scaling), if any."""
    a = arch.gguf_arch

    def need(key: str):
        if meta.get(f"{a}.{key}") is None:
            raise SourceError(f"GGUF metadata has no {a}.{key!r}")
        return meta[f"{a}.{key}"]

    names = set(tensor_names)
    d_model, n_heads = int(need("embedding_length")), int(need("attention.head_count"))
    if d_model < 1 or n_heads < 1:
        raise SourceError(f"GGUF {a}.embedding_length={d_model} and {a}.attention.head_count="
                          f"{n_heads} must be positive")
    head_dim = int(meta.get(f"{a}.attention.key_length") or d_model // n_heads)
    rot = meta.get(f"{a}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise SourceError(f"GGUF rope.dimension_count={rot} != head_dim={head_dim}: partial RoPE is unsupported")
    factors = rope_factors(meta, a, head_dim, rope_freqs)
    if "rope_factors_long.weight" in names or "rope_factors_short.weight" in names:
        raise SourceError("GGUF rope_factors_long / rope_factors_short (longrope scaling of the "
                          "Phi-3 128k models) is unsupported")
    n_layers = int(need("block_count"))
    window, sliding = sliding_layers(meta, a, n_layers, arch.gguf_swa_pattern)
    moe = gguf_moe_fields(meta, a, names, arch.gguf_norm_topk)
    qk_norm = "blk.0.attn_q_norm.weight" in names
    base = dict(
        arch=arch.name, vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=int(meta.get(f"{a}.attention.head_count_kv") or n_heads),
        head_dim=head_dim, n_ff=int(moe.pop("n_ff", None) or need("feed_forward_length")),
        context_length=int(need("context_length")), norm="rms",
        norm_eps=float(need("attention.layer_norm_rms_epsilon")), act="silu", glu=True, pos="rope",
        rope_theta=float(meta.get(f"{a}.rope.freq_base") or 10000.0), rope_freq_factors=factors,
        tied_embeddings="output.weight" not in names,
        attn_qkv_bias="blk.0.attn_q.bias" in names, attn_out_bias="blk.0.attn_output.bias" in names,
        qk_norm=qk_norm, qk_norm_full=qk_norm and arch.gguf_qk_norm_full,
        sliding_window=window, sliding_layers=sliding,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_ids=eos, **moe)
    cfg = ModelConfig(**base)
    return cfg.validate() if arch.gguf_fields is None else \
        ModelConfig(**{**base, **arch.gguf_fields(meta, cfg)}).validate()


def rope_factors(meta: Mapping, a: str, head_dim: int, rope_freqs: tuple[float, ...]) -> tuple[float, ...]:
    """The RoPE frequency divisors (model/rope.py) of a GGUF: its rope_freqs tensor, times a
    linear scaling's factor; any other scaling type is refused."""
    factors = tuple(float(v) for v in rope_freqs)
    if factors and len(factors) != head_dim // 2:
        raise SourceError(f"GGUF rope_freqs.weight has {len(factors)} values, head_dim {head_dim} "
                          f"needs {head_dim // 2}")
    scaling = meta.get(f"{a}.rope.scaling.type")
    if scaling == "linear":
        factor = float(meta.get(f"{a}.rope.scaling.factor") or 1.0)
        factors = tuple(f * factor for f in factors or (1.0,) * (head_dim // 2))
    elif scaling not in (None, "none"):
        raise SourceError(f"GGUF rope scaling {scaling!r} is unsupported (supported: none, linear, "
                          f"and llama3 as a rope_freqs tensor)")
    return factors


def sliding_layers(meta: Mapping, a: str, n_layers: int, pattern: int | None) -> tuple[int, tuple[int, ...]]:
    """(window, sliding layers) as llama.cpp reads them: {a}.attention.sliding_window, the layers
    from {a}.attention.sliding_window_pattern (a per-layer list, or n: every layer but each n-th;
    0: all) or the architecture's default `pattern`; (0, ()) without a window."""
    window = int(meta.get(f"{a}.attention.sliding_window") or 0)
    if window <= 0:
        return 0, ()
    if pattern is None:
        raise SourceError(f"GGUF {a}.attention.sliding_window={window} is unsupported for {a}")
    given = meta.get(f"{a}.attention.sliding_window_pattern", pattern)
    if isinstance(given, (list, tuple)):
        if len(given) < n_layers:
            raise SourceError(f"GGUF {a}.attention.sliding_window_pattern has {len(given)} "
                              f"entries for {n_layers} layers")
        return window, tuple(i for i in range(n_layers) if given[i])
    n = int(given)
    return window, tuple(i for i in range(n_layers) if n == 0 or i % n < n - 1)


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
