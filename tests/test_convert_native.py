"""The native conversion of a GGUF (the default for GGUF sources; flashllm/convert/native.py).

The references are the GGUF's own bytes (what gguf-py's reader gives) and gguf-py's dequantize:
every tensor the kernel has a type for must be stored byte for byte (llama-arch attn_q / attn_k
rows back in Hugging Face order), the FFN down columns re-quantized from the source's values,
and the model must compute what an f32 conversion of the same file computes, up to the down
columns' re-quantization (each layer's in the k-quant one step finer than its source's: the
bytes ggml's own quantizer makes, tests/test_kquant.py). Folders written before `down_dtype` existed still load.
"""
import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from flashllm.convert.convert import convert
from flashllm.convert.sources.gguf import unpermute_qk
from flashllm.format.reader import open_flash
from flashllm.runtime.model import Model

ROOT = Path(__file__).resolve().parent.parent
D, FF, HEADS, KV = 256, 256, 4, 2
BLOCK = {Q.Q6_K: (210, (208,)), Q.Q5_K: (176, (0, 2)), Q.Q4_K: (144, (0, 2)), Q.Q2_K: (84, (80, 82)),
         Q.Q3_K: (110, (108,))}


def k_rows(rng, qtype, rows: int, cols: int) -> np.ndarray:
    """(rows, bytes) random k-quant blocks with realistic f16 scales (gguf-py has no quantizer)."""
    bb, at = BLOCK[qtype]
    blk = rng.integers(0, 256, (rows, cols // 256, bb), dtype=np.uint8)
    for a in at:
        f = rng.uniform(2e-4, 1e-3, (rows, cols // 256)).astype(np.float16)
        blk[..., a:a + 2] = f.view(np.uint8).reshape(rows, -1, 2)
    return blk.reshape(rows, -1)


def stored_rows(rng, qtype, shape) -> np.ndarray:
    if qtype in BLOCK:
        return k_rows(rng, qtype, *shape)
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    return w if qtype == Q.F32 else quantize(w, qtype)


TYPES = {"token_embd.weight": Q.Q6_K, "output.weight": Q.BF16, "attn_q": Q.Q5_0,
         "attn_k": Q.Q4_K, "attn_v0": Q.Q5_1, "attn_v1": Q.Q8_0, "attn_output": Q.Q2_K,
         "ffn_gate": Q.Q5_K, "ffn_up": Q.Q5_K, "down0": Q.Q6_K, "down1": Q.Q4_K}


def write_mixed_gguf(path: Path, rng, types: dict = TYPES) -> dict:
    """A 2-layer llama GGUF whose tensors are in every type of types; returns the stored arrays."""
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in ((w.add_block_count, 2), (w.add_context_length, 64), (w.add_embedding_length, D),
                   (w.add_feed_forward_length, FF), (w.add_head_count, HEADS),
                   (w.add_head_count_kv, KV), (w.add_layer_norm_rms_eps, 1e-5),
                   (w.add_rope_freq_base, 10000.0), (w.add_eos_token_id, 3)):
        add(v)
    hd, stored = D // HEADS, {}
    shapes = {"token_embd.weight": (40, D), "output_norm.weight": (D,), "output.weight": (40, D)}
    for i in range(2):
        shapes.update({f"blk.{i}.attn_norm.weight": (D,), f"blk.{i}.ffn_norm.weight": (D,),
                       f"blk.{i}.attn_q.weight": (D, D), f"blk.{i}.attn_k.weight": (KV * hd, D),
                       f"blk.{i}.attn_v.weight": (KV * hd, D), f"blk.{i}.attn_output.weight": (D, D),
                       f"blk.{i}.ffn_gate.weight": (FF, D), f"blk.{i}.ffn_up.weight": (FF, D),
                       f"blk.{i}.ffn_down.weight": (D, FF)})
    for name, shape in shapes.items():
        kind = name.split(".")[-2] if name.startswith("blk.") else name
        kind = f"down{name.split('.')[1]}" if kind == "ffn_down" else \
            f"attn_v{name.split('.')[1]}" if kind == "attn_v" else kind
        qtype = Q.F32 if len(shape) == 1 else types[kind]
        data = (np.ones(shape, np.float32) if len(shape) == 1 else stored_rows(rng, qtype, shape))
        w.add_tensor(name, data, raw_dtype=None if qtype == Q.F32 else qtype)
        stored[name] = (qtype, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("native")
    stored = write_mixed_gguf(tmp / "m.gguf", np.random.default_rng(7))
    return tmp, stored, convert(tmp / "m.gguf", tmp / "native", None)    # the default: native


def test_dense_tensors_are_the_sources_bytes(mixed):
    tmp, stored, out = mixed
    flash = open_flash(out, verify=True)
    entries = {t["name"]: t for t in flash.manifest["dense"]["tensors"]}
    assert flash.dtype == "native"
    for name, (qtype, data) in stored.items():
        if "ffn_" in name or data.ndim == 1:
            continue
        got = flash.tensor(name)
        raw = data.view(np.uint8).reshape(data.shape[0], -1)             # (rows, bytes)
        if qtype == Q.BF16:                                               # widened, exactly
            assert got.dtype == "f32" and entries[name]["origin"]["how"] == "widened"
            np.testing.assert_array_equal(got.data.view(np.float32),
                                          dequantize(raw, qtype).reshape(got.rows, got.cols))
            continue
        heads = HEADS if "attn_q" in name else KV
        want = unpermute_qk(raw, heads) if name.split(".")[-2] in ("attn_q", "attn_k") else raw
        assert got.dtype == qtype.name.lower()
        np.testing.assert_array_equal(got.data, want)
        assert entries[name]["origin"] == {"from": qtype.name, "how": "copied"}


def test_ffn_rows_copied_and_down_columns_requantized(mixed):
    """Layer 0's Q6_K down goes to q6_k columns (none finer), layer 1's Q4_K to q5_k: each layer
    has its own stride (2 * 176 + 210 = 562 -> 576, 2 * 176 + 176 = 528 -> 544) and region."""
    _, stored, out = mixed
    flash = open_flash(out, verify=True)
    f = flash.ffn
    assert (f.dtype, f.part_bytes, f.down_dtypes, f.strides) == \
        ("q5_k", 176, ("q6_k", "q5_k"), (576, 544))
    assert f.stride == 576 and f.layer_offsets == [4096, 4096 + 36 * 4096]  # 256 * 576 = 36 pages
    for layer, (dd, err) in enumerate((("q6_k", 0.03), ("q5_k", 0.06))):
        b = flash.read_ffn_layer(layer)                                   # (FF, stride)
        assert b.shape == (FF, f.strides[layer])
        for k, part in enumerate(("gate", "up")):
            np.testing.assert_array_equal(b[:, 176 * k:176 * (k + 1)],
                                          stored[f"blk.{layer}.ffn_{part}.weight"][1])
        qtype, down = stored[f"blk.{layer}.ffn_down.weight"]
        cols = dequantize(down, qtype).reshape(D, FF).T                   # (FF, D)
        nb = 210 if dd == "q6_k" else 176
        back = dequantize(b[:, 352:352 + nb], Q.Q6_K if dd == "q6_k" else Q.Q5_K)  # gguf-py's
        assert not b[:, 352 + nb:].any()                                  # zero padding
        origin = flash.manifest["ffn"]["layers"][layer]["origin"]
        assert origin["gate"] == {"from": "Q5_K", "how": "copied"}
        assert (origin["down"]["from"], origin["down"]["to"]) == (qtype.name, dd)
        rel = np.linalg.norm(back.reshape(FF, D) - cols) / np.linalg.norm(cols)
        assert origin["down"]["rel_rms"] == pytest.approx(rel, rel=1e-4) and 0 < rel < err


def test_down_columns_are_ggml_s_own_quantization(mixed):
    """The columns' bytes are what llama.cpp's ggml_quantize_chunk makes of the same values."""
    from test_kquant import ggml_quantize
    _, stored, out = mixed
    flash = open_flash(out)
    for layer, dd in enumerate(("q6_k", "q5_k")):
        qtype, down = stored[f"blk.{layer}.ffn_down.weight"]
        cols = np.ascontiguousarray(dequantize(down, qtype).reshape(D, FF).T, np.float32)
        nb = 210 if dd == "q6_k" else 176
        np.testing.assert_array_equal(flash.read_ffn_layer(layer)[:, 352:352 + nb],
                                      ggml_quantize(cols, dd))


def logits_against_f32(gguf_path: Path, out: Path, tmp: Path):
    """(native exact, f32 conversion's, native int8) logits (6, 40) each of the same tokens: the
    f32 conversion holds every value exactly as the source (gguf-py's dequantize)."""
    f32 = convert(gguf_path, tmp / "f32", "f32")
    tokens = np.array([1, 17, 5, 39, 22, 8], np.int32)                    # (6,)
    a, ref = (Model(open_flash(p), n_threads=2, n_ctx=16, exact=True).forward(tokens, 0)
              for p in (out, f32))                                        # (6, 40) each
    c = Model(open_flash(out), n_threads=2, n_ctx=16).forward(tokens, 0)  # int8 activations
    return a, ref, c


def test_the_model_computes_what_the_source_does(mixed):
    """Logits of the native folder and of an f32 conversion (every value exactly the source's)
    of the same GGUF, both in f32 arithmetic: they differ by the down columns' re-rounding
    (3.5e-2 of the largest logit here with layer 1's in q4_k, 1.1e-2 with q8_0 columns; the
    same file's q8_0 conversion 1.3e-1, the native one with attn_q / attn_k blocks left in
    llama.cpp's row order 2.1e-1)."""
    tmp, _, out = mixed
    a, b, c = logits_against_f32(tmp / "m.gguf", out, tmp)
    assert np.abs(a - b).max() <= 5e-2 * np.abs(b).max()
    assert np.abs(a - b).max() > 0                                        # down really re-rounded
    assert np.abs(c - b).max() <= 1.5e-1 * np.abs(b).max()  # 1.0e-1 (8.2e-2 before attn_output's
    # Q2_K rows were kept: their activations are rounded per 256 values, as ggml's q8_K); q8_0's 1.5e-1


LOW_BITS = {**TYPES, "attn_q": Q.Q3_K, "attn_output": Q.Q3_K, "ffn_gate": Q.Q3_K,
            "ffn_up": Q.Q3_K, "down0": Q.Q2_K, "down1": Q.Q3_K}


def test_a_q2_k_q3_k_model_keeps_its_types(tmp_path):
    """Q3_K gate / up rows and attention, Q2_K / Q3_K down matrices (as a Q2_K or Q3_K_M GGUF
    stores them): copied byte for byte, the down matrices kept as rows too, their columns in
    q4_k (never coarser than the source); the model computes what the f32 conversion of the
    same file computes (gguf-py's values) up to those columns' re-rounding."""
    stored = write_mixed_gguf(tmp_path / "m.gguf", np.random.default_rng(3), LOW_BITS)
    out = convert(tmp_path / "m.gguf", tmp_path / "native", None)
    flash = open_flash(out, verify=True)
    f = flash.ffn
    assert (f.dtype, f.down_dtypes, f.part_bytes) == ("q3_k", ("q4_k", "q4_k"), 110)
    for layer in range(2):
        b = flash.read_ffn_layer(layer)                                   # (FF, stride)
        for k, part in enumerate(("gate", "up")):
            np.testing.assert_array_equal(b[:, 110 * k:110 * (k + 1)],
                                          stored[f"blk.{layer}.ffn_{part}.weight"][1])
        np.testing.assert_array_equal(flash.read_down_rows(layer).data,
                                      stored[f"blk.{layer}.ffn_down.weight"][1])
    got = flash.tensor("blk.0.attn_output.weight")
    assert got.dtype == "q3_k"
    np.testing.assert_array_equal(got.data, stored["blk.0.attn_output.weight"][1])
    a, ref, c = logits_against_f32(tmp_path / "m.gguf", out, tmp_path)
    assert 0 < np.abs(a - ref).max() <= 5e-2 * np.abs(ref).max()
    assert np.abs(c - ref).max() <= 1e-1 * np.abs(ref).max()


def test_convert_and_inspect_report_what_was_copied(mixed, tmp_path):
    tmp, _, out = mixed
    run = subprocess.run([sys.executable, "-m", "flashllm", "convert", str(tmp / "m.gguf"), "-o",
                          str(tmp_path / "again")], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    said = " ".join(run.stderr.split())
    assert "copied byte for byte: 2 Q2_K, 2 Q4_K, 2 Q5_0, 1 Q5_1, 4 Q5_K, 1 Q6_K, 1 Q8_0" in said
    assert "widened to f32: 1 BF16" in said
    assert "re-quantized Q2_K" not in said
    assert "re-quantized Q6_K -> q6_k: 1 tensor, relative RMS error" in said
    assert "re-quantized Q4_K -> q5_k: 1 tensor, relative RMS error" in said
    run = subprocess.run([sys.executable, "-m", "flashllm", "inspect", str(out), "--json"],
                         capture_output=True, text=True, cwd=ROOT)
    rows = {t["name"]: t for t in json.loads(run.stdout)["tensors"]}
    assert rows["blk.0.attn_v.weight"]["origin"] == {"from": "Q5_1", "how": "copied"}
    assert rows["output.weight"]["origin"] == {"from": "BF16", "how": "widened"}
    assert (rows["blk.0.ffn_down"]["dtype"], rows["blk.1.ffn_down"]["dtype"]) == ("q6_k", "q5_k")
    assert rows["blk.1.ffn_down"]["origin"]["how"] == "requantized"


def test_folders_from_before_down_dtype_still_load(mixed, tmp_path):
    """A q4_k folder's manifest as older flashllm wrote it (no down_dtype): down is q4_1."""
    tmp, _, _ = mixed
    out = convert(tmp / "m.gguf", tmp_path / "q41", "q4_1")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["ffn"].pop("down_dtype") == "q4_1"
    (out / "manifest.json").write_text(json.dumps(manifest))
    flash = open_flash(out, verify=True)
    assert (flash.dtype, flash.ffn.dtype, flash.ffn.down_dtype) == ("q4_1", "q4_1", "q4_1")
    tokens = np.array([1, 2, 3], np.int32)
    assert np.isfinite(Model(flash, n_threads=1, n_ctx=8).forward(tokens, 0)).all()


def test_a_folder_without_gguf_types_refuses_native(tmp_path):
    from tiny_sources import write_hf_llama   # an HF folder: no stored types
    src = write_hf_llama(tmp_path / "hf")
    from flashllm.errors import SourceError
    with pytest.raises(SourceError, match="a native conversion keeps a GGUF's own types"):
        convert(src, tmp_path / "out", "native")


def tiny_registry(gguf_path: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(a user cache holding gguf_path as models.toml model "tiny", that models.toml)."""
    import hashlib
    gguf = gguf_path.read_bytes()
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / "tiny.gguf").write_bytes(gguf)
    toml = tmp_path / "models.toml"
    toml.write_text(f'default = "tiny"\n[models.tiny]\ndescription = "d"\narch = "llama"\n'
                    f'default_dtype = "native"\nsize = {len(gguf)}\n'
                    f'sha256 = "{hashlib.sha256(gguf).hexdigest()}"\n[models.tiny.source]\n'
                    f'kind = "pypi"\npackages = ["x==1"]\nmembers = ["x/m.gguf"]\n')
    return cache, toml


def test_a_cached_conversion_of_an_older_recipe_is_made_again(mixed, tmp_path):
    """`run NAME` reuses a cached native conversion only while it is what this flashllm makes:
    one whose down columns an older flashllm wrote in q8_0 is converted again."""
    import shutil
    from flashllm.convert import native
    from flashllm.convert.resolve import resolve_model
    tmp, _, out = mixed
    manifest = json.loads((out / "manifest.json").read_text())
    assert native.outdated(manifest) is None and native.coarser(manifest) is None
    cache, toml = tiny_registry(tmp / "m.gguf", tmp_path)
    cached = cache / "converted" / "tiny-native"
    shutil.copytree(out, cached)
    said = []
    assert resolve_model("tiny", cache, toml, said.append) == cached and not said   # current
    old = json.loads((cached / "manifest.json").read_text())
    old["ffn"]["layers"][1]["origin"]["down"]["to"] = "q8_0"          # as an older recipe
    (cached / "manifest.json").write_text(json.dumps(old))
    assert "layer 1's Q4_K down columns are q8_0" in native.outdated(old)
    assert resolve_model("tiny", cache, toml, said.append) == cached
    assert any("converted by an older flashllm" in m for m in said)
    assert open_flash(cached).ffn.down_dtypes == ("q6_k", "q5_k")     # made again


def test_a_calibrated_conversion_with_the_sources_own_k_quant_is_kept_and_said(mixed, tmp_path):
    """A cached conversion of the recipe before (Q4_K down columns in q4_k, as flashllm made them
    until the step up) is converted again while nothing was calibrated in it (a minute); once
    calibrated (an hour) it is kept: `run` says once on stderr what it lacks and how to get it,
    `inspect` says it too."""
    from flashllm.convert import native
    from flashllm.convert.convert import convert_source
    from flashllm.convert.resolve import resolve_model
    from flashllm.convert.sources import open_source
    tmp, _, _ = mixed
    cache, toml = tiny_registry(tmp / "m.gguf", tmp_path)
    cached = cache / "converted" / "tiny-native"

    def convert_before() -> None:
        source = open_source(tmp / "m.gguf")
        try:
            convert_source(source, cached, "native", force=True, kquants=native.SAME_KQUANT)
        finally:
            source.close()
        assert open_flash(cached).ffn.down_dtypes == ("q6_k", "q4_k")
    convert_before()
    said = []
    assert resolve_model("tiny", cache, toml, said.append) == cached
    assert any("converted by an older flashllm" in m for m in said)
    assert open_flash(cached).ffn.down_dtypes == ("q6_k", "q5_k")     # uncalibrated: made again
    convert_before()
    m = json.loads((cached / "manifest.json").read_text())
    (cached / "manifest.json").write_text(json.dumps({**m, "sparsity": {"target": 0.5}}))
    before = (cached / "ffn.bin").stat().st_mtime_ns
    said.clear()
    assert resolve_model("tiny", cache, toml, said.append) == cached
    assert len(said) == 1 and "1 Q4_K layers in q4_k where this flashllm makes q5_k" in said[0]
    assert "convert its GGUF again" in said[0]
    assert (cached / "ffn.bin").stat().st_mtime_ns == before           # kept as it is
    assert open_flash(cached).ffn.down_dtypes == ("q6_k", "q4_k")
    run = subprocess.run([sys.executable, "-m", "flashllm", "inspect", str(cached), "--json"],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "one k-quant coarser" in json.loads(run.stdout)["older_recipe"]
    assert run.stderr.count("one k-quant coarser") == 1
