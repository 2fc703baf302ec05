"""Hugging Face safetensors sources against transformers (the reference): config mapping per
architecture, every tensor equal to the torch state_dict, shards, bf16/f16, and every refusal."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from flashllm.errors import SourceError
from flashllm.convert.sources import open_source
from hf_tiny import build_model, require_transformers

ARCHS = ["llama", "llama_tied", "qwen2", "qwen2_tied", "mistral", "opt", "opt_proj"]

# Spot checks written out by hand from the transformers module names (independent of arch.py).
SPOTS = {
    "llama": {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
              "blk.1.attn_q.weight": "model.layers.1.self_attn.q_proj.weight",
              "blk.1.attn_k.weight": "model.layers.1.self_attn.k_proj.weight",
              "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
              "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
              "blk.1.ffn_norm.weight": "model.layers.1.post_attention_layernorm.weight",
              "output_norm.weight": "model.norm.weight"},
    "qwen2": {"blk.1.attn_q.bias": "model.layers.1.self_attn.q_proj.bias",
              "blk.0.attn_v.bias": "model.layers.0.self_attn.v_proj.bias",
              "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight"},
    "opt": {"position_embd.weight": "model.decoder.embed_positions.weight",
            "blk.1.ffn_up.weight": "model.decoder.layers.1.fc1.weight",
            "blk.1.ffn_up.bias": "model.decoder.layers.1.fc1.bias",
            "blk.1.ffn_down.weight": "model.decoder.layers.1.fc2.weight",
            "blk.1.ffn_down.bias": "model.decoder.layers.1.fc2.bias",
            "blk.0.ffn_norm.bias": "model.decoder.layers.0.final_layer_norm.bias",
            "output_norm.bias": "model.decoder.final_layer_norm.bias",
            "blk.0.attn_output.bias": "model.decoder.layers.0.self_attn.out_proj.bias"},
    "opt_proj": {"proj_in.weight": "model.decoder.project_in.weight",
                 "proj_out.weight": "model.decoder.project_out.weight"},
}


def _state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def _check_config(name: str, cfg, hf) -> None:
    """ModelConfig fields against the transformers config object."""
    assert cfg.vocab_size == hf.vocab_size and cfg.d_model == hf.hidden_size
    assert cfg.n_layers == hf.num_hidden_layers and cfg.n_heads == hf.num_attention_heads
    assert cfg.tied_embeddings == bool(hf.tie_word_embeddings)
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    if name.startswith("opt"):
        assert (cfg.arch, cfg.norm, cfg.act, cfg.glu, cfg.pos) == ("opt", "layer", "relu", False, "learned")
        assert cfg.pos_offset == 2 and cfg.n_ff == hf.ffn_dim and cfg.n_kv_heads == cfg.n_heads
        assert cfg.context_length == hf.max_position_embeddings
        assert cfg.embed_dim == hf.word_embed_proj_dim
        assert cfg.attn_qkv_bias and cfg.attn_out_bias and cfg.ffn_bias
        return
    assert cfg.arch == name.split("_")[0]
    assert (cfg.norm, cfg.act, cfg.glu, cfg.pos) == ("rms", "silu", True, "rope")
    assert cfg.n_kv_heads == hf.num_key_value_heads and cfg.n_ff == hf.intermediate_size
    assert cfg.head_dim == hf.hidden_size // hf.num_attention_heads
    assert cfg.norm_eps == pytest.approx(hf.rms_norm_eps)
    assert cfg.rope_theta == pytest.approx(hf.rope_parameters["rope_theta"])
    assert cfg.attn_qkv_bias == (cfg.arch == "qwen2") and not cfg.attn_out_bias and not cfg.ffn_bias


@pytest.mark.parametrize("name", ARCHS)
def test_config_and_tensors_match_transformers(hf_tiny, name):
    folder, model = hf_tiny(name)
    state = _state(model)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    with open_source(folder) as src:
        _check_config(name, src.config, model.config)
        names = src.tensor_names()
        assert len(names) == len(set(names)) == len(state)
        loaded = {n: src.load(n) for n in names}
    for canonical, hf_name in {**SPOTS.get(name.split("_")[0], {}), **SPOTS.get(name, {})}.items():
        if canonical == "output.weight" and model.config.tie_word_embeddings:
            continue
        np.testing.assert_array_equal(loaded[canonical], state[hf_name], err_msg=canonical)
    # every state_dict tensor comes out exactly once (random values make the match unambiguous)
    by_bytes = {v.tobytes(): k for k, v in state.items()}
    matched = {by_bytes.get(v.astype(np.float32).tobytes()) for v in loaded.values()}
    assert matched == set(state)
    assert all(v.dtype == np.float32 for v in loaded.values())


def test_shape_is_hf_semantics(hf_tiny):
    folder, model = hf_tiny("llama")
    with open_source(folder) as src:
        assert src.tensor_shape("blk.0.ffn_up.weight") == (model.config.intermediate_size, model.config.hidden_size)
        assert src.tensor_shape("blk.0.attn_k.weight") == (2 * 16, 64)
        assert src.tokenizer_json is not None and src.chat_template is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoints(tmp_path, dtype):
    torch, _ = require_transformers()
    model = build_model("qwen2").to(getattr(torch, dtype))
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    with open_source(tmp_path) as src:
        np.testing.assert_array_equal(src.load("blk.1.ffn_gate.weight"), state["model.layers.1.mlp.gate_proj.weight"])
        np.testing.assert_array_equal(src.load("blk.0.attn_k.bias"), state["model.layers.0.self_attn.k_proj.bias"])


def test_sharded_checkpoint_with_index(tmp_path):
    require_transformers()
    model = build_model("llama")
    model.save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    state = _state(model)
    with open_source(tmp_path) as src:
        assert len(src.tensor_names()) == len(state)
        np.testing.assert_array_equal(src.load("output.weight"), state["lm_head.weight"])
        np.testing.assert_array_equal(src.load("blk.1.ffn_up.weight"), state["model.layers.1.mlp.up_proj.weight"])
    shard = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]["lm_head.weight"]
    (tmp_path / shard).unlink()
    with pytest.raises(SourceError, match=f"shard '{shard}'.*missing"):
        open_source(tmp_path)


def _copy(hf_tiny, name: str, dst: Path) -> Path:
    shutil.copytree(hf_tiny(name)[0], dst)
    return dst


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_pickles_are_refused_never_unpickled(tmp_path, hf_tiny):
    folder = _copy(hf_tiny, "llama", tmp_path / "m")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(SourceError, match="pytorch_model.bin.*convert it to safetensors"):
        open_source(folder)
    for suffix in (".bin", ".pt", ".pth", ".ckpt"):
        f = tmp_path / f"weights{suffix}"
        f.write_bytes(b"PK\x03\x04zip")
        with pytest.raises(SourceError, match="safetensors"):
            open_source(f)


def test_truncated_safetensors(tmp_path, hf_tiny):
    folder = _copy(hf_tiny, "llama", tmp_path / "m")
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(SourceError, match="model.safetensors: corrupt or truncated"):
        open_source(folder)


def test_unknown_hf_architecture(tmp_path, hf_tiny):
    folder = _copy(hf_tiny, "llama", tmp_path / "m")
    _edit_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(SourceError, match=r"GPT2LMHeadModel \(supported: ") as e:
        open_source(folder)
    listed = str(e.value).split("(supported: ")[1].rstrip(")").split(", ")
    assert {"Gemma3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "OPTForCausalLM",
            "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(listed)
    assert listed == sorted(listed) and "\n" not in str(e.value)


def test_unmapped_tensor_fails_loudly(tmp_path, hf_tiny):
    from safetensors.numpy import save_file
    folder = _copy(hf_tiny, "qwen2", tmp_path / "m")
    save_file({"model.layers.0.mlp.mystery.weight": np.ones((2, 2), np.float32)}, folder / "extra.safetensors")
    with pytest.raises(SourceError, match="'model.layers.0.mlp.mystery.weight' is not mapped"):
        open_source(folder)


def test_rotary_buffers_are_ignored_explicitly(tmp_path, hf_tiny):
    from safetensors.numpy import save_file
    folder = _copy(hf_tiny, "mistral", tmp_path / "m")
    save_file({"model.layers.1.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}, folder / "extra.safetensors")
    with open_source(folder) as src:
        assert not any("inv_freq" in n or "rotary" in n for n in src.tensor_names())


def test_missing_tensor(tmp_path, hf_tiny):
    folder = _copy(hf_tiny, "llama", tmp_path / "m")
    _edit_config(folder, num_hidden_layers=3)      # the checkpoint holds 2 layers
    with pytest.raises(SourceError, match="missing tensor 'blk.2.attn_norm.weight'"):
        open_source(folder)


@pytest.mark.parametrize("changes, message", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
     r"rope scaling 'yarn' is unsupported \(supported: default, linear, llama3\)"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": -1.0, "rope_theta": 1e4}},
     "rope scaling needs a positive 'factor'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope scaling 'dynamic' is unsupported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is unsupported"),
    ({"mlp_bias": True}, "mlp_bias=True is unsupported"),
])
def test_llama_refusals(tmp_path, hf_tiny, changes, message):
    folder = _copy(hf_tiny, "llama", tmp_path / "m")
    _edit_config(folder, **changes)
    with pytest.raises(SourceError, match=message):
        open_source(folder)


def test_phi3_longrope_refused(tmp_path, hf_tiny):
    folder = _copy(hf_tiny, "phi3", tmp_path / "m")
    _edit_config(folder, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                          "long_factor": [1.0] * 8, "short_factor": [1.0] * 8})
    with pytest.raises(SourceError, match=r"rope scaling 'longrope' is unsupported \(supported: "):
        open_source(folder)


def test_phi3_fused_tensors_are_split(tmp_path, hf_tiny):
    """qkv_proj and gate_up_proj become attn_q / attn_k / attn_v and ffn_gate / ffn_up rows."""
    folder, hf = hf_tiny("phi3")
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    q, kv, ff = 4 * 16, 2 * 16, 112
    qkv, gate_up = sd["model.layers.1.self_attn.qkv_proj.weight"], sd["model.layers.1.mlp.gate_up_proj.weight"]
    with open_source(folder) as src:
        for name, want in (("attn_q", qkv[:q]), ("attn_k", qkv[q:q + kv]), ("attn_v", qkv[q + kv:]),
                           ("ffn_gate", gate_up[:ff]), ("ffn_up", gate_up[ff:])):
            assert src.tensor_shape(f"blk.1.{name}.weight") == want.shape
            np.testing.assert_array_equal(src.load(f"blk.1.{name}.weight"), want)


def test_opt_post_layernorm_refused(tmp_path, hf_tiny):
    folder = _copy(hf_tiny, "opt", tmp_path / "m")
    _edit_config(folder, do_layer_norm_before=False)
    with pytest.raises(SourceError, match="do_layer_norm_before=False"):
        open_source(folder)


def test_chat_template_and_generation_eos(tmp_path, hf_tiny):
    folder = _copy(hf_tiny, "qwen2", tmp_path / "m")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    with open_source(folder) as src:
        assert src.chat_template == "D" and src.config.eos_token_ids == (2, 7)
    (folder / "chat_template.jinja").write_text("J")
    (folder / "tokenizer.json").unlink()
    with open_source(folder) as src:
        assert src.chat_template == "J" and src.tokenizer_json is None


def test_dispatch_errors(tmp_path):
    with pytest.raises(SourceError, match="no such file"):
        open_source(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no \\*.safetensors"):
        open_source(tmp_path / "empty")
    (tmp_path / "x.gguf").write_bytes(b"GGML....")
    with pytest.raises(SourceError, match="not a GGUF file"):
        open_source(tmp_path / "x.gguf")
    (tmp_path / "w.safetensors").write_bytes(b"\x08" + b"\0" * 7 + b"{}      ")
    with pytest.raises(SourceError, match="lone safetensors file"):
        open_source(tmp_path / "w.safetensors")
