"""The flash format: writer → reader round trip against numpy / gguf-py, bundle contents, layout
alignment, writer states, and the reader's validation of damaged folders."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from flashllm.format.reader import open_flash
from flashllm.format.files import update_manifest
from flashllm.format.writer import FlashWriter, WriterState
from flashllm.format.layout import ffn_weight
from flashllm.errors import FormatError
from flashllm.model.tensor import QTensor
from tiny_sources import TOKENIZER_JSON, ref_dequant, ref_rows, tiny_arrays, tiny_config

DTYPES = ("f32", "f16", "q8_0", "q4_0")


def write(out, cfg, arrays, dtype, orders=None):
    """Write arrays through FlashWriter directly (dense tensors, then FFN layers)."""
    with FlashWriter(out, cfg, dtype, source={"name": "test"}) as w:
        w.set_tokenizer(TOKENIZER_JSON, "{{x}}")
        for name, x in arrays.items():
            if not ffn_weight(name):
                w.add_tensor(name, x)
        for i in range(cfg.n_layers):
            w.add_ffn_layer(i, arrays.get(f"blk.{i}.ffn_gate.weight"), arrays[f"blk.{i}.ffn_up.weight"],
                            arrays[f"blk.{i}.ffn_down.weight"], None if orders is None else orders[i])
        return w.finish()


@pytest.fixture(scope="module")
def cfg():
    return tiny_config()


@pytest.fixture(scope="module")
def arrays(cfg):
    return tiny_arrays(cfg)


@pytest.fixture
def model_dir(tmp_path, cfg, arrays):
    return write(tmp_path / "m", cfg, arrays, "q8_0")


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_round_trip_equals_reference_quantization(tmp_path, cfg, arrays, dtype):
    flash = open_flash(write(tmp_path / "m", cfg, arrays, dtype), verify=True)
    assert flash.config == cfg and flash.dtype == dtype
    assert flash.tokenizer_json == TOKENIZER_JSON and flash.chat_template == "{{x}}"
    for name, x in arrays.items():
        if ffn_weight(name):
            assert not flash.has(name)
            continue
        t = flash.tensor(name)
        if x.ndim == 1:
            np.testing.assert_array_equal(t, x)
            continue
        want = "f16" if dtype in ("q8_0", "q4_0") and x.shape[1] % 32 else dtype
        assert isinstance(t, QTensor) and t.dtype == want and (t.rows, t.cols) == x.shape
        np.testing.assert_array_equal(t.data, ref_rows(x, want), err_msg=name)


def test_f16_fallback_for_rows_not_a_multiple_of_32(model_dir, arrays):
    t = open_flash(model_dir).tensor("blk.0.attn_output.weight")            # (64, 48)
    assert t.dtype == "f16"
    np.testing.assert_allclose(ref_dequant(t.data, "f16", 48), arrays["blk.0.attn_output.weight"],
                               rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("glu", [True, False])
def test_bundle_i_holds_gate_row_up_row_down_column(tmp_path, dtype, glu):
    cfg = tiny_config(glu=glu)
    arrays = tiny_arrays(cfg, seed=1)
    flash = open_flash(write(tmp_path / "m", cfg, arrays, dtype), verify=True)
    f = flash.ffn
    parts = ["gate", "up", "down"] if glu else ["up", "down"]
    assert f.stride % 32 == 0 and f.stride >= len(parts) * f.part_bytes
    for layer in range(cfg.n_layers):
        bundles = flash.read_ffn_layer(layer)                               # (n_ff, stride)
        assert bundles.shape == (cfg.n_ff, f.stride)
        assert not bundles[:, len(parts) * f.part_bytes:].any()            # padding is zero
        for k, part in enumerate(parts):
            w = arrays[f"blk.{layer}.ffn_{part}.weight"]
            rows = w.T if part == "down" else w                             # (n_ff, d_model)
            got = bundles[:, k * f.part_bytes:(k + 1) * f.part_bytes]
            np.testing.assert_array_equal(got, ref_rows(np.ascontiguousarray(rows), dtype))


def test_neuron_order_puts_neuron_order_j_in_slot_j(tmp_path, cfg, arrays):
    rng = np.random.default_rng(5)
    orders = [rng.permutation(cfg.n_ff), None]
    flash = open_flash(write(tmp_path / "m", cfg, arrays, "f32", orders), verify=True)
    np.testing.assert_array_equal(flash.ffn.neuron_order[0], orders[0])
    np.testing.assert_array_equal(flash.ffn.neuron_order[1], np.arange(cfg.n_ff))
    bundles = flash.read_ffn_layer(0).view(np.float32)                      # (n_ff, stride / 4)
    d = cfg.d_model
    np.testing.assert_array_equal(bundles[:, :d], arrays["blk.0.ffn_gate.weight"][orders[0]])
    np.testing.assert_array_equal(bundles[:, 2 * d:3 * d], arrays["blk.0.ffn_down.weight"].T[orders[0]])


def test_layout_alignment_and_headers(model_dir, cfg):
    m = json.loads((model_dir / "manifest.json").read_text())
    assert (m["magic"], m["format_version"], m["sparsity"], m["predictor"]) == ("flashllm", 1, {}, {})
    assert m["ffn"]["neuron_order"] is None
    dense = (model_dir / "dense.bin").read_bytes()
    assert dense[:8] == b"FLDENSE\0" and struct.unpack_from("<I", dense, 8)[0] == 1
    assert len(dense) == m["dense"]["nbytes"] and len(dense) % 64 == 0
    assert all(t["offset"] % 64 == 0 and t["offset"] >= 64 for t in m["dense"]["tensors"])
    ffn = (model_dir / "ffn.bin").read_bytes()
    assert ffn[:8] == b"FLFFN\0\0\0" and len(ffn) == m["ffn"]["nbytes"] and len(ffn) % 4096 == 0
    assert [e["offset"] for e in m["ffn"]["layers"]] == [4096 + i * m["ffn"]["layer_bytes"]
                                                        for i in range(cfg.n_layers)]
    assert m["ffn"]["part_bytes"] == 68 and m["ffn"]["stride"] == 224      # 3 × 68 = 204 → 224
    assert (model_dir / "tokenizer.json").read_text() == TOKENIZER_JSON
    assert sorted(p.name for p in model_dir.iterdir()) == ["dense.bin", "ffn.bin", "manifest.json",
                                                           "tokenizer.json"]


def test_writer_enforces_state_order(tmp_path, cfg, arrays):
    up, down = arrays["blk.0.ffn_up.weight"], arrays["blk.0.ffn_down.weight"]
    gate = arrays["blk.0.ffn_gate.weight"]
    with pytest.raises(FormatError, match="writer state open"):
        with FlashWriter(tmp_path / "a", cfg, "f32") as w:
            w.add_ffn_layer(0, gate, up, down)
    with pytest.raises(FormatError, match="is an FFN weight"):
        with FlashWriter(tmp_path / "b", cfg, "f32") as w:
            w.add_tensor("blk.0.ffn_up.weight", up)
    with pytest.raises(FormatError, match="writer state ffn"):
        with FlashWriter(tmp_path / "c", cfg, "f32") as w:
            w.add_tensor("token_embd.weight", arrays["token_embd.weight"])
            w.add_ffn_layer(0, gate, up, down)
            w.add_tensor("output.weight", arrays["output.weight"])
    with pytest.raises(FormatError, match="out of order"):
        with FlashWriter(tmp_path / "d", cfg, "f32") as w:
            w.add_tensor("token_embd.weight", arrays["token_embd.weight"])
            w.add_ffn_layer(1, gate, up, down)
    with pytest.raises(FormatError, match="after 1 of 2 FFN layers"):
        with FlashWriter(tmp_path / "e", cfg, "f32") as w:
            w.add_tensor("token_embd.weight", arrays["token_embd.weight"])
            w.add_ffn_layer(0, gate, up, down)
            w.finish()
    with pytest.raises(FormatError, match=r"finish\(\) without tensor output_norm.weight"):
        write(tmp_path / "g", cfg, {k: v for k, v in arrays.items() if k != "output_norm.weight"}, "f32")
    w = FlashWriter(tmp_path / "f", cfg, "f32")
    w.abort()
    assert w.state is WriterState.ABORTED
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ---- validation: every damaged folder names the file and the problem -------------------------

def _edit_manifest(model_dir, edit):
    path = model_dir / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


def _truncate(path, n=1):
    data = path.read_bytes()
    path.write_bytes(data[:-n])


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _drop_tensor(m, name):
    m["dense"]["tensors"] = [t for t in m["dense"]["tensors"] if t["name"] != name]


DAMAGE = {
    "no folder": (lambda d: d.rename(d.with_name("gone")), "no such model folder"),
    "no manifest": (lambda d: (d / "manifest.json").unlink(), r"manifest.json: missing"),
    "bad json": (lambda d: (d / "manifest.json").write_text("{oops"), "not valid JSON"),
    "manifest magic": (lambda d: _edit_manifest(d, lambda m: m.update(magic="gguf")), "bad magic"),
    "manifest version": (lambda d: _edit_manifest(d, lambda m: m.update(format_version=3)),
                         "format version 3, this flashllm reads versions 1, 2"),
    "rows version": (lambda d: _edit_manifest(d, lambda m: m.update(format_version=2)),
                     "format version 2 without expert rows"),
    "bad config": (lambda d: _edit_manifest(d, lambda m: m["config"].update(n_heads=0)), "n_heads"),
    "dense truncated": (lambda d: _truncate(d / "dense.bin"), r"dense.bin: \d+ bytes, the manifest says"),
    "ffn truncated": (lambda d: _truncate(d / "ffn.bin", 4096), r"ffn.bin: \d+ bytes, the manifest says"),
    "dense magic": (lambda d: _patch(d / "dense.bin", 0, b"XXXXXXXX"), r"dense.bin: bad magic"),
    "ffn magic": (lambda d: _patch(d / "ffn.bin", 0, b"XXXXXXXX"), r"ffn.bin: bad magic"),
    "ffn version": (lambda d: _patch(d / "ffn.bin", 8, struct.pack("<I", 7)),
                    r"ffn.bin: format version 7"),
    "dense version": (lambda d: _patch(d / "dense.bin", 8, struct.pack("<I", 9)),
                      r"dense.bin: format version 9"),
    "missing tensor": (lambda d: _edit_manifest(d, lambda m: _drop_tensor(m, "blk.1.attn_k.weight")),
                       "required tensor blk.1.attn_k.weight is missing"),
    "tensor size": (lambda d: _edit_manifest(d, lambda m: m["dense"]["tensors"][0].update(nbytes=8)),
                    "has 8 bytes, its shape and dtype need"),
    "tensor outside": (lambda d: _edit_manifest(d, lambda m: m["dense"]["tensors"][-1].update(
        offset=m["dense"]["nbytes"] - 64)), "lies outside dense.bin"),
    "overlap": (lambda d: _edit_manifest(d, lambda m: m["dense"]["tensors"][1].update(
        offset=m["dense"]["tensors"][0]["offset"])), "overlap"),
    "ffn stride": (lambda d: _edit_manifest(d, lambda m: m["ffn"].update(stride=100)), "stride 100"),
    "ffn layer misaligned": (lambda d: _edit_manifest(d, lambda m: m["ffn"]["layers"][1].update(
        offset=4096 + 100)), r"layers\[1\]: region at 4196 is misaligned"),
    "ffn glu": (lambda d: _edit_manifest(d, lambda m: m["ffn"].update(glu=False)), "glu=False"),
    "tokenizer missing": (lambda d: (d / "tokenizer.json").unlink(), r"tokenizer.json: missing"),
    "tokenizer path": (lambda d: _edit_manifest(d, lambda m: m["tokenizer"].update(file="../x")),
                       "not a plain file name"),
    "tokenizer merges": (lambda d: _edit_manifest(d, lambda m: m["tokenizer"].update(merges="x")),
                         r"manifest.json tokenizer: merges 'x' is not one of strings, pairs, none$"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_folder_is_refused_with_a_clear_message(model_dir, case):
    damage, message = DAMAGE[case]
    damage(model_dir)
    with pytest.raises(FormatError, match=message):
        open_flash(model_dir)


def test_the_tokenizer_json_is_read_when_asked_for_and_checked_then(model_dir):
    """The model keeps no copy of the text (a one-shot run drops its own once the prompt is
    encoded): each read checks the file again."""
    flash = open_flash(model_dir)
    assert flash.tokenizer_json == TOKENIZER_JSON
    assert TOKENIZER_JSON not in [v for v in vars(flash).values() if isinstance(v, str)]
    _patch(model_dir / "tokenizer.json", 0, b"\xff")
    with pytest.raises(FormatError, match=r"tokenizer.json: unreadable \('utf-8' codec"):
        flash.tokenizer_json
    (model_dir / "tokenizer.json").write_text(TOKENIZER_JSON + " ")
    with pytest.raises(FormatError, match=r"tokenizer.json: \d+ bytes, the manifest says \d+ "
                                          r"\(changed since the model was opened\)"):
        flash.tokenizer_json


@pytest.mark.parametrize("file, where, message", [
    ("dense.bin", lambda m: m["dense"]["tensors"][3]["offset"] + 5, "checksum mismatch in tensor"),
    ("ffn.bin", lambda m: m["ffn"]["layers"][1]["offset"] + 77, "checksum mismatch in FFN layer 1"),
])
def test_verify_detects_a_flipped_byte(model_dir, file, where, message):
    m = json.loads((model_dir / "manifest.json").read_text())
    offset = where(m)
    data = (model_dir / file).read_bytes()
    _patch(model_dir / file, offset, bytes([data[offset] ^ 0x40]))
    open_flash(model_dir)                                   # structure is still valid
    with pytest.raises(FormatError, match=message):
        open_flash(model_dir, verify=True)


def test_a_neuron_order_that_is_not_a_permutation_is_refused(tmp_path, cfg, arrays):
    orders = [np.arange(cfg.n_ff)[::-1], None]
    out = write(tmp_path / "m", cfg, arrays, "q4_0", orders)
    _patch(out / "order.bin", 0, struct.pack("<i", 1))                       # slot 0 → neuron 1 twice
    with pytest.raises(FormatError, match=r"order.bin: a layer's neuron order is not a permutation"):
        open_flash(out)
    with pytest.raises(FormatError, match="not a permutation of 0..95"):
        write(tmp_path / "n", cfg, arrays, "q4_0", [np.zeros(cfg.n_ff, int), None])
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_update_manifest_fills_the_reserved_sections(model_dir):
    update_manifest(model_dir, sparsity={"thresholds": [0.5, 0.25]})
    flash = open_flash(model_dir, verify=True)
    assert flash.manifest["sparsity"] == {"thresholds": [0.5, 0.25]} and flash.manifest["predictor"] == {}
    assert sorted(p.name for p in model_dir.iterdir()) == ["dense.bin", "ffn.bin", "manifest.json",
                                                           "tokenizer.json"]
    with pytest.raises(FormatError, match=r"sections \['config'\] cannot be updated"):
        update_manifest(model_dir, config={})
