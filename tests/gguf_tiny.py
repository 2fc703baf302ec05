"""The tiny transformers checkpoints of hf_tiny.py written as GGUF files the way llama.cpp's
convert_hf_to_gguf.py writes them, so a GGUF source can be checked against transformers.

Tensor names come from gguf-py's own HF -> GGUF name map (gguf.get_tensor_name_map, the table
llama.cpp's converter uses), not from flashllm's tables. What the converter changes on the way is
redone here from its description: llama permutes attn_q / attn_k for interleaved RoPE (qwen2,
qwen3, phi3 and gemma3 are not permuted); gemma3 adds 1 to every `*norm.weight`; llama3 rope
scaling becomes a `rope_freqs.weight` tensor of per-frequency divisors, linear scaling the
rope.scaling keys. Phi-3's fused qkv_proj and gate_up_proj stay fused (attn_qkv, a 2·n_ff-row
ffn_up), as llama.cpp stores them. A Gemma 3 whose layer_types are not llama.cpp's default
pattern (every 6th layer global) gets the per-layer sliding_window_pattern list llama.cpp reads
(its converter writes none for gemma3: such a model is not made there).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

GGUF_ARCH = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "phi3": "PHI3", "gemma3": "GEMMA3"}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF rotate-half rows -> interleaved pairs."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """(head_dim / 2,) f32 divisors of each RoPE frequency, as the converter derives them from a
    llama3 rope_scaling (Llama 3.1 paper's piecewise rule)."""
    base = rope["rope_theta"]
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)   # (hd/2,)
    factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _metadata(w, cfg, arch: str) -> None:
    import gguf
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    if rope.get("full_attention", rope).get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["full_attention"]["factor"])
    if "sliding_attention" in rope:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if getattr(cfg, "final_logit_softcapping", None):
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if getattr(cfg, "sliding_window", None) and arch in ("phi3", "gemma3"):
        w.add_sliding_window(cfg.sliding_window)
    types = getattr(cfg, "layer_types", None)
    if arch == "gemma3" and types != [("full_attention" if (i + 1) % 6 == 0 else "sliding_attention")
                                      for i in range(len(types))]:
        # not llama.cpp's default pattern (every 6th layer global): the per-layer list it reads
        w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)


def write_gguf(model, path: Path, arch: str) -> Path:
    """Write the transformers model (f32) as an F32 GGUF of llama.cpp architecture `arch`."""
    import gguf
    cfg = model.config
    tmap = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, GGUF_ARCH[arch]), cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, cfg, arch)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, head_dim))
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        value = p.detach().float().numpy().copy()
        gname = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, f"gguf-py maps no name for {name}"
        if arch == "llama" and ".attn_q." in gname:
            value = llamacpp_permute(value, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gname:
            value = llamacpp_permute(value, cfg.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            value = value + 1.0
        w.add_tensor(gname, value.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
