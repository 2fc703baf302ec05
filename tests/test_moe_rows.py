"""A mixture-of-experts GGUF's native conversion keeps its experts' bytes (convert/native_moe.py,
docs/FORMAT.md "Expert rows"): every expert's gate, up and down rows are the GGUF's, byte for
byte, for a Q4_0 file and for llama.cpp's Q4_K_M mix (Q4_K gate / up, Q6_K / Q4_K down by layer);
the model computes what an f32 conversion of the same file computes (gguf-py's dequantization:
the values exactly), in DRAM and with the experts streamed from flash under a budget.

Fixtures: scripts/fixtures/make_moe_gguf.py's random OLMoE-shape GGUF at its small shape (4
layers, d_model 256, 8 experts of n_ff 256, top-2), and tests/moe_gguf.py's tiny transformers
MoEs (mixed expert types: the re-quantizing fallback, a shared expert)."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from flashllm.convert import native
from flashllm.convert.convert import convert
from flashllm.format.reader import open_flash
from flashllm.runtime.model import Model
from scripts.fixtures.make_moe_gguf import SMALL, write as write_moe

ROOT = Path(__file__).resolve().parent.parent
TOKENS = np.random.default_rng(3).integers(0, 256, size=10).astype(np.int32)   # (10,) byte tokens


@pytest.fixture(scope="module", params=["q4_0", "q4_k_m"])
def small(request, tmp_path_factory):
    """(GGUF path, native folder, f32 folder) of the small fixture of one kind."""
    tmp = tmp_path_factory.mktemp(request.param)
    gguf = write_moe(tmp / "m.gguf", request.param, shape=SMALL, log=lambda m: None)
    return gguf, convert(gguf, tmp / "native", None), convert(gguf, tmp / "f32", "f32")


def test_experts_are_the_gguf_rows(small):
    """Every expert's slots hold its gate rows, up rows and down rows exactly as the GGUF stores
    them (gguf-py's reader), the manifest says so, and the folder is format version 2."""
    gguf, out, _ = small
    flash = open_flash(out, verify=True)
    f, cfg = flash.ffn, flash.config
    assert f.expert_rows and flash.manifest["format_version"] == 2
    stored = {t.name: t for t in GGUFReader(gguf).tensors}
    for layer in range(cfg.n_layers):
        slots = flash.read_ffn_layer(layer)                               # (slots, stride)
        want = {p: stored[f"blk.{layer}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")}
        assert f.down_dtypes[layer] == want["down"].tensor_type.name.lower()
        for e in range(cfg.n_experts):
            got = slots[e * cfg.n_ff:(e + 1) * cfg.n_ff].reshape(-1)
            parts = [np.asarray(want[p].data[e]).view(np.uint8).reshape(-1) for p in want]
            n = sum(len(p) for p in parts)
            np.testing.assert_array_equal(got[:n], np.concatenate(parts))
            assert not got[n:].any()                                      # zero padding
        origin = flash.manifest["ffn"]["layers"][layer]["origin"]
        assert {p: o["how"] for p, o in origin.items()} == dict.fromkeys(want, "copied")


def test_logits_match_an_f32_conversion(small):
    """The native folder against the f32 conversion of the same GGUF: in f32 arithmetic the
    same values (< 1e-4 of the largest logit); on int8 activations, as the dense tests allow
    (test_convert_native: 1.5e-1)."""
    _, out, f32 = small
    ref = Model(open_flash(f32), n_threads=2, n_ctx=16, exact=True).forward(TOKENS, 0)
    a = Model(open_flash(out), n_threads=2, n_ctx=16, exact=True).forward(TOKENS, 0)
    c = Model(open_flash(out), n_threads=2, n_ctx=16).forward(TOKENS, 0)
    scale = np.abs(ref).max()
    print(f"exact {np.abs(a - ref).max() / scale:.2e}, int8 {np.abs(c - ref).max() / scale:.2e}")
    assert np.abs(a - ref).max() <= 1e-4 * scale
    assert np.abs(c - ref).max() <= 1.5e-1 * scale


@pytest.mark.parametrize("cached", [0, 3])
def test_streamed_experts_match_dram(small, cached):
    """Experts read from flash under a budget (0 or 3 cached per layer; prefill then decode)
    compute what the experts held in DRAM compute, on int8 activations."""
    from flashllm.ffi.reader import Reader
    from flashllm.format.manifest import read_manifest
    from flashllm.runtime.budget import parse_budget, plan_budget
    from flashllm.runtime.expert_ffn import ExpertFlashFfn
    _, out, _ = small
    flash = open_flash(out)
    plan = dataclasses.replace(plan_budget(read_manifest(out), parse_budget(str(1 << 40)), 16,
                                           process=0),
                               capacity=cached * flash.config.n_ff, staging_rows=7)
    ffn = ExpertFlashFfn(flash, plan, Reader(flash.ffn.file, n_threads=2), n_threads=2)
    net = Model(flash, n_threads=2, n_ctx=16, ffn=ffn)
    got = np.concatenate([net.forward(TOKENS[:6], 0)] +
                         [net.forward(TOKENS[p:p + 1], p) for p in range(6, 10)])
    stats = ffn.stats()["decode_mean"]
    ffn.close()
    ref = Model(open_flash(out), n_threads=2, n_ctx=16).forward(TOKENS, 0)
    assert stats["bytes_read"] > 0
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())


def test_inspect_says_copied(small):
    """`flashllm inspect --json` (what `inspect --tensors` prints) lists every layer's expert
    gate, up and down as the GGUF's type, copied byte for byte; the table says expert rows."""
    gguf, out, _ = small
    argv = [sys.executable, "-m", "flashllm", "inspect", str(out)]
    run = subprocess.run(argv + ["--json"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    rows = {t["name"]: t for t in json.loads(run.stdout)["tensors"]}
    for t in GGUFReader(gguf).tensors:
        if "_exps" in t.name:
            row = rows[t.name.removesuffix(".weight")]
            assert row["dtype"] == t.tensor_type.name.lower()
            assert row["origin"] == {"from": t.tensor_type.name, "how": "copied"}
    table = subprocess.run(argv + ["--tensors"], capture_output=True, text=True, cwd=ROOT)
    said = " ".join(table.stdout.split())
    assert "expert rows [gate | up | down]" in said and "copied byte for byte" in said


def test_an_older_native_moe_folder_is_converted_again(small):
    """A native MoE folder of bundles (before expert rows) is an older recipe: `run NAME`
    converts it again (native.outdated names why)."""
    _, out, _ = small
    m = json.loads((out / "manifest.json").read_text())
    assert native.outdated(m) is None
    m["ffn"].pop("experts")
    assert "re-quantized q8_0 bundles" in native.outdated(m)


@pytest.mark.parametrize("name", ["qwen2_moe", "olmoe"])
def test_mixed_expert_types_fall_back(hf_tiny, tmp_path, name):
    """tests/moe_gguf.py's experts (gate Q8_0, up Q4_0: no one type; down F16, n_ff not whole
    blocks of 32): gate / up re-quantized to q8_0, down rows kept as F16, shared expert too; the
    logits stay within the re-quantization's error of transformers with the stored experts."""
    from moe_gguf import write_moe_gguf
    from test_moe import hf_logits, rel_err, with_experts
    folder, hf = hf_tiny(name)
    written = write_moe_gguf(folder, tmp_path / "m.gguf", quantize_experts=True)
    out = convert(tmp_path / "m.gguf", tmp_path / "m", None)
    flash = open_flash(out)
    assert flash.ffn.expert_rows and (flash.ffn.dtype, set(flash.ffn.down_dtypes)) == ("q8_0", {"f16"})
    origin = flash.manifest["ffn"]["layers"][0]["origin"]
    assert origin["down"] == {"from": "F16", "how": "copied"}
    assert origin["up"]["how"] == "requantized" and 0 < origin["up"]["rel_rms"] < 1e-2
    prompt = np.random.default_rng(7).integers(3, 64, size=12)
    err = rel_err(Model(flash, n_threads=2, n_ctx=32, exact=True).forward(prompt, 0),
                  hf_logits(with_experts(hf, written), prompt))
    print(f"{name}: native (q8_0 gate / up) vs transformers {err:.2e}")
    assert err < 2e-2


def test_conversion_memory_does_not_grow_with_the_experts(tmp_path):
    """One expert in memory at a time: 16x the experts' bytes (8 experts of n_ff 256 -> 32 of
    1024: a layer's three expert tensors 0.9 -> 14 MiB of Q4_0, 100 MiB as f32) convert in the
    same heap (tracemalloc; the GGUF's file map not counted): 1.3 and 1.3 MiB measured."""
    from test_convert_memory import _traced_peak
    shapes = (SMALL, dataclasses.replace(SMALL, experts=32, n_ff=1024))
    peaks = []
    for i, shape in enumerate(shapes):
        gguf = write_moe(tmp_path / f"{i}.gguf", "q4_0", shape=shape, log=lambda m: None)
        peaks.append(_traced_peak(gguf, tmp_path / f"{i}.flash", None) / 2**20)
    print(f"conversion heap peaks {peaks[0]:.1f} -> {peaks[1]:.1f} MiB")
    assert peaks[1] - peaks[0] < 8 and peaks[1] < 24, f"peaks {peaks[0]:.1f} -> {peaks[1]:.1f} MiB"
