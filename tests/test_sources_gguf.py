"""GGUF sources against gguf-py (writer and dequantizer) and transformers' own GGUF loader.

Small files are written here with gguf.GGUFWriter; Q/K weights are permuted exactly as llama.cpp's
convert_hf_to_gguf.py does (LlamaModel.permute, written out below), so the un-permute is checked
against the forward transform and, on SmolLM2, against transformers."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from flashllm.errors import SourceError
from flashllm.convert.sources import open_source

D, HEADS, KV, HD, FF, LAYERS, VOCAB = 64, 4, 2, 16, 96, 2, 40


def llamacpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, HF rotate-half -> GGUF interleaved."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def hf_weights(rng, qkv_bias: bool, tied: bool) -> dict[str, np.ndarray]:
    """Random weights in HF semantics under canonical names."""
    w = {"token_embd.weight": rng.standard_normal((VOCAB, D)), "output_norm.weight": rng.standard_normal(D)}
    if not tied:
        w["output.weight"] = rng.standard_normal((VOCAB, D))
    for i in range(LAYERS):
        shapes = {"attn_norm.weight": (D,), "attn_q.weight": (HEADS * HD, D), "attn_k.weight": (KV * HD, D),
                  "attn_v.weight": (KV * HD, D), "attn_output.weight": (D, HEADS * HD), "ffn_norm.weight": (D,),
                  "ffn_gate.weight": (FF, D), "ffn_up.weight": (FF, D), "ffn_down.weight": (D, FF)}
        if qkv_bias:
            shapes.update({"attn_q.bias": (HEADS * HD,), "attn_k.bias": (KV * HD,), "attn_v.bias": (KV * HD,)})
        w.update({f"blk.{i}.{k}": rng.standard_normal(s) for k, s in shapes.items()})
    return {k: v.astype(np.float32) for k, v in w.items()}


QTYPES = {"attn_k.weight": Q.Q8_0, "ffn_up.weight": Q.Q4_0, "ffn_down.weight": Q.Q8_0, "attn_v.weight": Q.F16}


def write_gguf(path: Path, arch: str, weights: dict[str, np.ndarray], extra=None, permute: bool = True) -> dict:
    """Write `weights` (HF semantics) as llama.cpp would; return what each tensor holds on disk."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(50000.0)
    w.add_eos_token_id(3)
    (extra or (lambda writer: None))(w)
    stored = {}
    for name, value in weights.items():
        part = name.split(".", 2)[-1] if name.startswith("blk.") else name
        if permute and part.startswith("attn_q."):
            value = llamacpp_permute(value, HEADS, HEADS)
        elif permute and part.startswith("attn_k."):
            value = llamacpp_permute(value, HEADS, KV)
        qtype = QTYPES.get(part, Q.F32)
        raw = gguf.quants.quantize(value, qtype) if qtype not in (Q.F32, Q.F16) else value.astype(
            np.float16 if qtype == Q.F16 else np.float32)
        w.add_tensor(name, raw, raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
        stored[name] = gguf.quants.dequantize(raw, qtype).reshape(value.shape) if qtype != Q.F32 else value
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.mark.parametrize("arch, qkv_bias, tied", [("llama", False, True), ("llama", True, False), ("qwen2", True, False)])
def test_small_gguf_roundtrip(tmp_path, arch, qkv_bias, tied):
    weights = hf_weights(np.random.default_rng(0), qkv_bias, tied)
    permuted = arch == "llama"
    stored = write_gguf(tmp_path / "m.gguf", arch, weights, permute=permuted)
    with open_source(tmp_path / "m.gguf") as src:
        cfg = src.config
        assert (cfg.arch, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_ff) == (
            arch, D, LAYERS, HEADS, KV, HD, FF)
        assert cfg.vocab_size == VOCAB and cfg.tied_embeddings == tied and cfg.attn_qkv_bias == qkv_bias
        assert cfg.rope_theta == 50000.0 and cfg.norm_eps == pytest.approx(1e-5) and cfg.context_length == 256
        assert cfg.eos_token_ids == (3,) and src.tokenizer_json is None
        assert sorted(src.tensor_names()) == sorted(weights)
        for name, original in weights.items():
            ours = src.load(name)
            assert ours.shape == original.shape == src.tensor_shape(name) and ours.dtype == np.float32
            part = name.split(".", 2)[-1]
            if part in QTYPES:      # lossy storage: our un-permute must invert llama.cpp's permute
                heads = (HEADS, KV if "attn_k" in name else HEADS)
                redo = llamacpp_permute(ours, *heads) if permuted and part.startswith("attn_") and part[5] in "qk" else ours
                np.testing.assert_array_equal(redo, stored[name], err_msg=name)
                np.testing.assert_allclose(ours, original, atol=0.25 * np.abs(original).max(), err_msg=name)
            else:                   # exact storage: we get the HF tensor back bit for bit
                np.testing.assert_array_equal(ours, original, err_msg=name)


def test_unknown_gguf_architecture(tmp_path):
    write_gguf(tmp_path / "m.gguf", "mamba", {"token_embd.weight": np.ones((VOCAB, D), np.float32)})
    with pytest.raises(SourceError, match=r"m.gguf: unsupported GGUF architecture 'mamba' \(supported: ") as e:
        open_source(tmp_path / "m.gguf")
    listed = str(e.value).split("(supported: ")[1].rstrip(")").split(", ")
    assert {"llama", "qwen2", "qwen3", "phi3", "gemma3", "qwen2moe", "qwen3moe", "olmoe"} <= set(listed) \
        and "\n" not in str(e.value)


def test_unmapped_gguf_tensor(tmp_path):
    weights = hf_weights(np.random.default_rng(1), False, True)
    weights["blk.0.attn_rot_embd.weight"] = np.ones(HD // 2, np.float32)
    write_gguf(tmp_path / "m.gguf", "llama", weights)
    with pytest.raises(SourceError, match="tensor 'blk.0.attn_rot_embd.weight' is not expected"):
        open_source(tmp_path / "m.gguf")


def test_rope_freqs_of_the_wrong_length_refused(tmp_path):
    weights = hf_weights(np.random.default_rng(1), False, True)
    weights["rope_freqs.weight"] = np.ones(HD // 2 + 1, np.float32)
    write_gguf(tmp_path / "m.gguf", "llama", weights)
    with pytest.raises(SourceError, match=f"rope_freqs.weight has {HD // 2 + 1} values, head_dim {HD} needs {HD // 2}"):
        open_source(tmp_path / "m.gguf")


def test_truncated_and_corrupt_gguf(tmp_path):
    write_gguf(tmp_path / "m.gguf", "llama", hf_weights(np.random.default_rng(2), False, True))
    data = (tmp_path / "m.gguf").read_bytes()
    for cut, why in ((len(data) - 1000, "cut short"), (200, "more than its 200 bytes can hold"),
                     (10, "ends inside its 24-byte header")):
        (tmp_path / "t.gguf").write_bytes(data[:cut])
        with pytest.raises(SourceError, match=f"t.gguf: (corrupt GGUF: .*{why}|truncated GGUF)") as e:
            open_source(tmp_path / "t.gguf")
        assert "Error" not in str(e.value) and "dtype" not in str(e.value)   # no numpy internals
    bad = bytearray(data)
    bad[4:8] = (7).to_bytes(4, "little")                                    # version 7
    (tmp_path / "t.gguf").write_bytes(bad)
    with pytest.raises(SourceError, match="unknown GGUF version 7"):
        open_source(tmp_path / "t.gguf")
    bad[4:8], bad[8:16] = (3).to_bytes(4, "little"), (1 << 40).to_bytes(8, "little")
    (tmp_path / "t.gguf").write_bytes(bad)
    with pytest.raises(SourceError, match=r"counts 1099511627776 tensors .* more than its"):
        open_source(tmp_path / "t.gguf")


def test_rope_scaling_refused(tmp_path):
    weights = hf_weights(np.random.default_rng(3), False, True)
    write_gguf(tmp_path / "m.gguf", "llama", weights, extra=lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN))
    with pytest.raises(SourceError, match="rope scaling 'yarn' is unsupported"):
        open_source(tmp_path / "m.gguf")


# ------------------------------------------------------------------ real models


@pytest.fixture(scope="module")
def smollm():
    from conftest import gguf_path
    path = gguf_path("smollm2-135m")
    with open_source(path) as src:
        yield src, gguf.GGUFReader(path)


@pytest.mark.realmodel
def test_smollm_tensors_equal_gguf_py(smollm):
    src, reader = smollm
    raw = {t.name: t for t in reader.tensors}
    for name in ("token_embd.weight", "blk.3.ffn_down.weight", "blk.3.attn_norm.weight", "blk.3.attn_v.weight"):
        t = raw[name]
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(src.tensor_shape(name))
        np.testing.assert_array_equal(src.load(name), ref, err_msg=name)
    for name, heads in (("blk.3.attn_q.weight", (9, 9)), ("blk.3.attn_k.weight", (9, 3))):
        t = raw[name]
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(src.tensor_shape(name))
        np.testing.assert_array_equal(llamacpp_permute(src.load(name), *heads), ref, err_msg=name)


@pytest.mark.realmodel
def test_smollm_unpermute_matches_transformers_gguf_loader(smollm):
    """transformers' GGUF loader de-permutes llama Q/K with its own code (LlamaTensorProcessor):
    an independent reference for our un-permute. (Its full from_pretrained needs accelerate.)"""
    pytest.importorskip("torch")
    gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    src, reader = smollm
    processor = gguf_utils.LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    raw = {t.name: t for t in reader.tensors}
    for name in ("blk.5.attn_q.weight", "blk.5.attn_k.weight"):
        t = raw[name]
        theirs = processor.process(weights=gguf.quants.dequantize(t.data, t.tensor_type), name=name).weights
        np.testing.assert_array_equal(src.load(name), theirs, err_msg=name)
    assert (src.config.n_heads, src.config.n_kv_heads, src.config.head_dim) == (9, 3, 64)
    assert src.config.tied_embeddings and src.config.eos_token_ids[0] == 2


@pytest.mark.realmodel
def test_qwen05_mixed_quant_types_equal_gguf_py():
    from conftest import gguf_path
    path = gguf_path("qwen2.5-coder-0.5b")
    reader = gguf.GGUFReader(path)
    qk = ("blk.2.attn_q.weight", "blk.2.attn_k.bias")      # qwen2 GGUFs are not permuted
    picks = {t.name: t for t in reader.tensors if t.name in qk}
    for t in sorted(reader.tensors, key=lambda t: int(t.n_elements)):   # the smallest of every type
        picks.setdefault(t.tensor_type.name, t)
    with open_source(path) as src:
        assert src.config.arch == "qwen2" and src.config.attn_qkv_bias and not src.config.tied_embeddings
        assert src.config.eos_token_ids[0] == 151645
        for t in picks.values():
            ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(src.tensor_shape(t.name))
            np.testing.assert_array_equal(src.load(t.name), ref, err_msg=f"{t.name} {t.tensor_type.name}")
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32"} <= set(picks)


def test_longrope_factors_refused(tmp_path):
    weights = hf_weights(np.random.default_rng(1), False, True)
    weights["rope_factors_long.weight"] = np.ones(HD // 2, np.float32)
    weights["rope_factors_short.weight"] = np.ones(HD // 2, np.float32)
    write_gguf(tmp_path / "m.gguf", "phi3", weights, permute=False)
    with pytest.raises(SourceError, match="longrope scaling of the Phi-3 128k models"):
        open_source(tmp_path / "m.gguf")
