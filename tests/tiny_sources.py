"""Test inputs for the format and convert tests: a Source over numpy arrays, a tiny HF llama folder
written with safetensors.numpy, and gguf-py reference bytes for each storage dtype."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, quants

from flashllm.convert.sources.base import Source
from flashllm.format.layout import required_tensors
from flashllm.model.config import ModelConfig

GGML = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
TOKENIZER_JSON = json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}}})


def tiny_config(glu: bool = True, **kw) -> ModelConfig:
    """A 2-layer model; head_dim 12 makes attn_output's rows 48 values (not a multiple of 32)."""
    base = dict(arch="qwen2" if glu else "opt", vocab_size=40, d_model=64, n_layers=2, n_heads=4,
                n_kv_heads=2, head_dim=12, n_ff=96, context_length=32,
                norm="rms" if glu else "layer", norm_eps=1e-6, act="silu" if glu else "relu",
                glu=glu, pos="rope" if glu else "learned", attn_qkv_bias=True,
                attn_out_bias=not glu, ffn_bias=not glu)
    return ModelConfig(**{**base, **kw}).validate()


class ArraySource(Source):
    """The sources.Source protocol over numpy arrays (canonical names, HF layout, f32)."""

    def __init__(self, config: ModelConfig, arrays: dict[str, np.ndarray],
                 tokenizer_json: str | None = TOKENIZER_JSON, chat_template: str | None = "{{x}}"):
        self.config, self.arrays = config, arrays
        self.tokenizer_json, self.chat_template = tokenizer_json, chat_template
        self.closed = False

    def tensor_names(self) -> list[str]:
        return list(self.arrays)

    def tensor_nbytes(self, name):
        return 4 * int(np.prod(self.arrays[name].shape))

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.arrays[name].shape

    def load(self, name: str) -> np.ndarray:
        return self.arrays[name].astype(np.float32, copy=True)

    def close(self) -> None:
        self.closed = True


def tiny_arrays(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random f32 tensors for every dense and FFN tensor the config needs."""
    rng = np.random.default_rng(seed)
    arrays = {n: rng.standard_normal(s).astype(np.float32) for n, s in required_tensors(cfg).items()}
    for i in range(cfg.n_layers):
        parts = {"up": (cfg.n_ff, cfg.d_model), "down": (cfg.d_model, cfg.n_ff)}
        if cfg.glu:
            parts["gate"] = (cfg.n_ff, cfg.d_model)
        for part, shape in parts.items():
            arrays[f"blk.{i}.ffn_{part}.weight"] = rng.standard_normal(shape).astype(np.float32)
    return arrays


def ref_rows(x: np.ndarray, dtype: str) -> np.ndarray:
    """Reference storage bytes of rows x (rows, cols) f32: numpy for f32/f16, gguf-py otherwise."""
    if dtype in GGML:
        return quants.quantize(x, GGML[dtype])                              # (rows, row_bytes)
    return x.astype("<f4" if dtype == "f32" else "<f2").view(np.uint8)      # (rows, row_bytes)


def ref_dequant(raw: np.ndarray, dtype: str, cols: int) -> np.ndarray:
    """Values (rows, cols) f32 of stored rows raw (rows, row_bytes), decoded independently."""
    if dtype in GGML:
        return quants.dequantize(raw, GGML[dtype]).reshape(-1, cols)
    return raw.view("<f4" if dtype == "f32" else "<f2").astype(np.float32).reshape(-1, cols)


def write_arrays(out: Path, cfg, arrays: dict, dtype: str, orders: dict | None = None) -> None:
    """A flash model folder from canonical arrays through FlashWriter; orders: layer -> (n_ff,)
    neuron order for the layers stored reordered."""
    from flashllm.format.writer import FlashWriter
    from flashllm.format.layout import ffn_weight
    orders = orders or {}
    with FlashWriter(out, cfg, dtype, source={"name": "test"}) as w:
        w.set_tokenizer(TOKENIZER_JSON, None)
        for name, x in arrays.items():
            if not ffn_weight(name):
                w.add_tensor(name, x)
        for i in range(cfg.n_layers):
            w.add_ffn_layer(i, arrays.get(f"blk.{i}.ffn_gate.weight"),
                            arrays[f"blk.{i}.ffn_up.weight"], arrays[f"blk.{i}.ffn_down.weight"],
                            orders.get(i))
        w.finish()


def write_hf_llama(folder: Path, seed: int = 0) -> Path:
    """A tiny Hugging Face llama checkpoint (config.json + model.safetensors, f32)."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    d, ff, n_layers, vocab, heads, kv = 64, 96, 2, 40, 4, 2
    hd = d // heads
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,),
              "lm_head.weight": (vocab, d)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (heads * hd, d),
                       p + "self_attn.k_proj.weight": (kv * hd, d),
                       p + "self_attn.v_proj.weight": (kv * hd, d),
                       p + "self_attn.o_proj.weight": (d, heads * hd),
                       p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
                       p + "mlp.down_proj.weight": (d, ff)})
    folder.mkdir(parents=True, exist_ok=True)
    save_file({n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()},
              str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d,
              "intermediate_size": ff, "num_hidden_layers": n_layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 64,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder
