"""A tiny MoE transformers checkpoint (tests/hf_tiny.py) re-written as llama.cpp writes MoE GGUFs:
each layer's experts stacked into 3-D `ffn_{gate,up,down}_exps` tensors, the router
`ffn_gate_inp`, Qwen2-MoE's shared expert `*_shexp` and its gate `ffn_gate_inp_shexp` (1-D), and
for the llama architecture (Mixtral) Q/K permuted for interleaved RoPE. Names and keys follow
llama.cpp's convert_hf_to_gguf.py (written out here, not taken from flashllm)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open

GGUF_ARCH = {"MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe",
             "Qwen3MoeForCausalLM": "qwen3moe", "OlmoeForCausalLM": "olmoe"}
LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
         "self_attn.v_proj.bias": "attn_v.bias",
         "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
         "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
         "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
         "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
         "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
         "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"}
EXPERT = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
# storage of the stacked experts: gate and up rows run along d_model (a multiple of 32), down's
# along the expert's n_ff (not one): F16
EXPS_TYPES = {"gate": Q.Q8_0, "up": Q.Q4_0, "down": Q.F16}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF rotate-half rows -> interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stored(value: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray]:
    """(bytes or array to write, the values gguf-py reads back) of value in qtype."""
    if qtype == Q.F32:
        return value, value
    if qtype == Q.F16:
        raw = value.astype(np.float16)
        return raw, raw.astype(np.float32)
    raw = gguf.quants.quantize(value, qtype)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(value.shape)


def hf_tensors(folder: Path) -> dict[str, np.ndarray]:
    with safe_open(str(folder / "model.safetensors"), "numpy") as f:
        return {k: f.get_tensor(k).astype(np.float32) for k in f.keys()}


def write_moe_gguf(folder: Path, path: Path, quantize_experts: bool = False) -> dict:
    """Write the HF MoE checkpoint at folder as a GGUF at path; returns {(layer, part): the
    stacked experts (n_experts, rows, cols) as stored} for building a matching reference."""
    cfg = json.loads((folder / "config.json").read_text())
    hf_class = cfg["architectures"][0]
    arch = GGUF_ARCH[hf_class]
    n_layers, d, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"]
    n_exp = cfg.get("num_experts") or cfg["num_local_experts"]
    w = gguf.GGUFWriter(str(path), arch)
    for add, value in ((w.add_block_count, n_layers), (w.add_context_length, cfg["max_position_embeddings"]),
                       (w.add_embedding_length, d), (w.add_feed_forward_length, cfg["intermediate_size"]),
                       (w.add_head_count, heads), (w.add_head_count_kv, kv),
                       (w.add_layer_norm_rms_eps, cfg["rms_norm_eps"]),
                       (w.add_rope_freq_base, cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]),
                       (w.add_expert_count, n_exp), (w.add_expert_used_count, cfg["num_experts_per_tok"]),
                       (w.add_eos_token_id, 2)):
        add(value)
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if cfg.get("norm_topk_prob") and arch in ("qwen2moe", "olmoe"):   # llama.cpp's default: off
        w.add_expert_weights_norm(True)
    tensors, experts = hf_tensors(folder), {}
    for name, value in tensors.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m is None:
            w.add_tensor(GLOBAL[name], value)
            continue
        i, rest = int(m.group(1)), m.group(2)
        e = re.fullmatch(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight", rest)
        if e is not None:
            experts.setdefault((i, EXPERT[e.group(2)]), {})[int(e.group(1))] = value
            continue
        if arch == "llama" and rest.startswith("self_attn.q_proj"):
            value = permute(value, heads)
        elif arch == "llama" and rest.startswith("self_attn.k_proj"):
            value = permute(value, kv)
        w.add_tensor(f"blk.{i}.{LAYER[rest]}", value.reshape(-1) if rest.endswith("shared_expert_gate.weight") else value)
    written = {}
    for (i, part), per in sorted(experts.items()):
        stack = np.stack([per[e] for e in range(n_exp)])                     # (n_exp, rows, cols)
        raw, written[i, part] = stored(stack, EXPS_TYPES[part] if quantize_experts else Q.F32)
        qtype = EXPS_TYPES[part] if quantize_experts else Q.F32
        w.add_tensor(f"blk.{i}.ffn_{part}_exps.weight", raw,
                     raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written
