"""GGUF metadata -> ModelConfig (llama.cpp's keys, `{arch}.embedding_length` and the like)."""
from __future__ import annotations

from typing import Iterable, Mapping

from flashllm.errors import SourceError
from flashllm.model.arch import Arch
from flashllm.model.config import ModelConfig


def gguf_config(arch: Arch, meta: Mapping, tensor_names: Iterable[str], vocab_size: int,
                eos: tuple[int, ...]) -> ModelConfig:
    """ModelConfig from GGUF metadata (`meta`: key -> value). Tied when output.weight is absent."""
    a = arch.gguf_arch

    def need(key: str):
        if meta.get(f"{a}.{key}") is None:
            raise SourceError(f"GGUF metadata has no {a}.{key!r}")
        return meta[f"{a}.{key}"]

    names = set(tensor_names)
    d_model, n_heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get(f"{a}.attention.key_length") or d_model // n_heads)
    rot = meta.get(f"{a}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise SourceError(f"GGUF rope.dimension_count={rot} != head_dim={head_dim}: partial RoPE is unsupported")
    scaling = meta.get(f"{a}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise SourceError(f"GGUF rope scaling {scaling!r} is unsupported (only plain RoPE)")
    return ModelConfig(
        arch=arch.name, vocab_size=vocab_size, d_model=d_model, n_layers=int(need("block_count")),
        n_heads=n_heads, n_kv_heads=int(meta.get(f"{a}.attention.head_count_kv") or n_heads),
        head_dim=head_dim, n_ff=int(need("feed_forward_length")),
        context_length=int(need("context_length")), norm="rms",
        norm_eps=float(need("attention.layer_norm_rms_epsilon")), act="silu", glu=True, pos="rope",
        rope_theta=float(meta.get(f"{a}.rope.freq_base") or 10000.0),
        tied_embeddings="output.weight" not in names,
        attn_qkv_bias="blk.0.attn_q.bias" in names, attn_out_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_ids=eos,
    ).validate()
