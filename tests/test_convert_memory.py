"""A conversion's memory does not grow with the model (one row block, one block of an FFN layer's
neurons at a time), and `convert --force` replaces only flashllm's own files of a folder."""
from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter

from flashllm.convert.convert import convert
from flashllm.errors import FormatError
from flashllm.format import files
from flashllm.format.reader import open_flash

Q8_BLOCK = 34                                  # bytes of a Q8_0 block of 32: f16 scale, 32 int8


def _q8_rows(rng, rows: int, cols: int) -> np.ndarray:
    """Random Q8_0 rows (rows, cols / 32 * 34) uint8, values of std ~1/sqrt(cols)."""
    raw = rng.integers(-127, 128, size=(rows, cols // 32, Q8_BLOCK), dtype=np.int16)
    raw = raw.astype(np.int8).view(np.uint8)                              # (rows, blocks, 34)
    raw[..., :2] = np.frombuffer(np.float16(cols ** -0.5 / 73).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def dense_gguf(path: Path, d: int, n_ff: int, vocab: int, layers: int = 2) -> Path:
    """A llama-architecture GGUF of random Q8_0 matrices (f32 norms), with an output head."""
    rng = np.random.default_rng(0)
    heads = d // 64
    w = GGUFWriter(str(path), arch="llama")
    for add, v in ((w.add_block_count, layers), (w.add_context_length, 256),
                   (w.add_embedding_length, d), (w.add_feed_forward_length, n_ff),
                   (w.add_head_count, heads), (w.add_head_count_kv, heads),
                   (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0)):
        add(v)
    table = [("token_embd.weight", (vocab, d))]
    for i in range(layers):
        table += [(f"blk.{i}.{n}", s) for n, s in (
            ("attn_norm.weight", (d,)), ("attn_q.weight", (d, d)), ("attn_k.weight", (d, d)),
            ("attn_v.weight", (d, d)), ("attn_output.weight", (d, d)), ("ffn_norm.weight", (d,)),
            ("ffn_gate.weight", (n_ff, d)), ("ffn_up.weight", (n_ff, d)),
            ("ffn_down.weight", (d, n_ff)))]
    table += [("output_norm.weight", (d,)), ("output.weight", (vocab, d))]
    for name, shape in table:
        if len(shape) == 1:
            w.add_tensor(name, np.ones(shape, np.float32))
        else:
            w.add_tensor(name, _q8_rows(rng, *shape), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _traced_peak(src: Path, out: Path, dtype: str | None) -> int:
    """Bytes of the largest Python / numpy heap converting src needed (file maps not counted)."""
    tracemalloc.start()
    try:
        convert(src, out, dtype)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("dtype", [None, "q8_0"])
def test_conversion_peak_does_not_grow_with_the_model(tmp_path, dtype):
    """A model 4x larger (its head and each FFN matrix: 2x d_model, 2x vocab, 4x n_ff)
    converts in the same memory: 7.4 and 7.5 MiB measured, where a whole-tensor conversion
    needs 37 and 92 MiB (the larger one's f32 head alone is 32 MiB)."""
    small = dense_gguf(tmp_path / "small.gguf", d=256, n_ff=1024, vocab=8192)
    large = dense_gguf(tmp_path / "large.gguf", d=512, n_ff=4096, vocab=16384)
    peaks = [_traced_peak(src, tmp_path / f"{src.stem}.flash", dtype) / 2**20
             for src in (small, large)]
    assert peaks[1] - peaks[0] < 4 and peaks[1] < 16, \
        f"peak {peaks[0]:.1f} MiB (small) -> {peaks[1]:.1f} MiB (4x head and FFN)"
    assert open_flash(tmp_path / "large.flash", verify=True).config.vocab_size == 16384


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return dense_gguf(tmp_path_factory.mktemp("g") / "tiny.gguf", d=128, n_ff=256, vocab=512, layers=1)


def _user_files(out: Path) -> None:
    (out / "my_notes.txt").write_text("mine")
    (out / "results").mkdir()
    (out / "results" / "run1.json").write_text("{}")


def test_force_replaces_only_flashllms_files(tmp_path, tiny_gguf):
    out = convert(tiny_gguf, tmp_path / "m.flash", "q8_0")
    _user_files(out)
    convert(tiny_gguf, out, None, force=True)             # native: down.bin is new
    assert open_flash(out, verify=True).dtype == "native"
    assert (out / "my_notes.txt").read_text() == "mine"
    assert (out / "results" / "run1.json").read_text() == "{}"
    convert(tiny_gguf, out, "f16", force=True)            # down.bin goes with the old model
    assert not (out / "down.bin").exists() and open_flash(out, verify=True).dtype == "f16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.flash"]   # no trash left
    assert (out / "my_notes.txt").read_text() == "mine"


def test_force_refuses_to_overwrite_a_user_file_naming_it(tmp_path, tiny_gguf):
    out = convert(tiny_gguf, tmp_path / "m.flash", "q8_0")
    (out / "down.bin").write_text("mine, not flashllm's")   # the native conversion writes one
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(FormatError, match="holds down.bin, which flashllm did not write"):
        convert(tiny_gguf, out, None, force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.flash"]


def test_an_interrupted_replacement_looks_invalid_and_a_rerun_finishes_it(tmp_path, tiny_gguf,
                                                                          monkeypatch):
    out = convert(tiny_gguf, tmp_path / "m.flash", "q8_0")
    _user_files(out)
    real, calls = os.rename, []

    def dies_at_the_fourth(a, b):                      # the old manifest and 2 files are out
        calls.append(b)
        if len(calls) == 4:
            raise KeyboardInterrupt
        real(a, b)
    monkeypatch.setattr(files.os, "rename", dies_at_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_gguf, out, None, force=True)
    monkeypatch.setattr(files.os, "rename", real)
    assert not (out / "manifest.json").exists()
    with pytest.raises(FormatError):
        open_flash(out)
    convert(tiny_gguf, out, None, force=True)
    assert open_flash(out, verify=True).dtype == "native"
    assert (out / "my_notes.txt").read_text() == "mine" and (out / "results").is_dir()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
