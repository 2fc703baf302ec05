"""A native conversion keeps the GGUF's own FFN down matrices (down.bin), byte for byte, and a
run holding the whole FFN in DRAM multiplies those rows (runtime/ffn.py DenseFfn `rows`).

References: the GGUF's bytes (what gguf-py's reader gives) and gguf-py's dequantization; the
FFN computed in float64 numpy from gguf-py's dequantized gate / up / down, with x and h rounded
to int8 as the kernel rounds them (per 256 values, d = amax / 127, nearest even: llama.cpp's
q8_K), which the rows path must match up to f32 sums; without that rounding, up to it."""
import json
import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from flashllm.convert import native
from flashllm.convert.convert import convert
from flashllm.errors import FormatError
from flashllm.format.reader import open_flash
from flashllm.runtime.ffn import DenseFfn
from flashllm.runtime.model import Model
from test_convert_native import D, FF, TYPES, write_mixed_gguf
from test_kernel import _quantize_x


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rows")
    # attn_output in Q8_0 (TYPES' Q2_K rows round their activations per 256 values, which here
    # amplifies the rows / bundles difference this file measures: 1.3e-1 against 2.9e-2)
    types = {**TYPES, "attn_output": Q.Q8_0}
    stored = write_mixed_gguf(tmp / "m.gguf", np.random.default_rng(11), types)
    return tmp, stored, convert(tmp / "m.gguf", tmp / "native", None)


def test_down_rows_are_the_sources_bytes(mixed):
    _, stored, out = mixed
    flash = open_flash(out, verify=True)
    assert [e["dtype"] for e in flash.down_rows] == ["q6_k", "q4_k"]
    for layer in range(2):
        qtype, data = stored[f"blk.{layer}.ffn_down.weight"]
        got = flash.read_down_rows(layer)
        assert (got.rows, got.cols, got.dtype) == (D, FF, qtype.name.lower())
        np.testing.assert_array_equal(got.data, data.reshape(D, -1))
        assert flash.down_rows[layer]["offset"] % 4096 == 0


def test_a_corrupt_down_file_fails_verification(mixed, tmp_path):
    _, _, out = mixed
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    entry = open_flash(bad).down_rows[1]
    with open(bad / "down.bin", "r+b") as f:
        f.seek(entry["offset"] + 100)
        byte = f.read(1)
        f.seek(entry["offset"] + 100)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(FormatError, match="checksum mismatch in layer 1"):
        open_flash(bad, verify=True)


def int8(x: np.ndarray, block: int = 256) -> np.ndarray:
    """x (T, n) rounded as the kernel's activations: per `block` values (256 for k-quant weights,
    32 for the others), ggml's rule (test_kernel._quantize_x), back to d * q in f64."""
    return _quantize_x(x, block)[0]


def reference_ffn(stored, layer: int, x: np.ndarray, q=lambda v: v) -> np.ndarray:
    """(T, D) float64: down @ q(silu(gate @ q(x)) * (up @ q(x))) from gguf-py's dequantized
    weights (q: the activations' rounding, or none)."""
    w = {}
    for p, shape in (("gate", (FF, D)), ("up", (FF, D)), ("down", (D, FF))):
        qtype, data = stored[f"blk.{layer}.ffn_{p}.weight"]
        w[p] = dequantize(data, qtype).reshape(shape).astype(np.float64)  # shape
    g, u = q(x) @ w["gate"].T, q(x) @ w["up"].T                            # (T, FF) each
    return q(g / (1.0 + np.exp(-g)) * u) @ w["down"].T                     # (T, D)


@pytest.mark.parametrize("T", [1, 3, 12])
def test_rows_ffn_against_gguf_py(mixed, T):
    """The rows path (int8 x and h, as llama.cpp) is the f64 FFN on the same int8 activations
    up to f32 sums (measured 2e-7 of the largest value), and within 5% of the unrounded one
    (3.6%: random blocks make h heavy-tailed)."""
    _, stored, out = mixed
    ffn = DenseFfn(open_flash(out), n_threads=2)
    assert ffn.rows
    x = np.random.default_rng(T).standard_normal((T, D)).astype(np.float32)  # (T, D)
    for layer in range(2):
        y = np.zeros((T, D), np.float32)                                   # (T, D)
        ffn(layer, x, y)
        ref = reference_ffn(stored, layer, x, int8)
        assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
        exact = reference_ffn(stored, layer, x.astype(np.float64))
        assert np.abs(y - exact).max() <= 5e-2 * np.abs(exact).max()


def test_rows_and_bundles_give_the_same_tokens(mixed, tmp_path):
    """The same folder without down.bin (as converted before it existed) runs over the bundles;
    its logits differ from the rows path's by the down columns' re-rounding only."""
    _, _, out = mixed
    old = tmp_path / "old"
    shutil.copytree(out, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["down_rows"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    (old / "down.bin").unlink()
    assert "lacks the GGUF's own FFN down rows" in native.outdated(manifest)
    assert native.outdated(json.loads((out / "manifest.json").read_text())) is None
    tokens = np.array([1, 17, 5, 39, 22, 8], np.int32)                     # (6,)
    a, b = (Model(open_flash(p), n_threads=2, n_ctx=16) for p in (out, old))
    assert a.ffn.rows and not b.ffn.rows
    la, lb = a.forward(tokens, 0), b.forward(tokens, 0)                    # (6, 40) each
    assert np.abs(la - lb).max() <= 1e-1 * np.abs(lb).max()


def test_exact_and_thresholds_keep_the_bundles(mixed):
    _, _, out = mixed
    assert not DenseFfn(open_flash(out), 1, exact=True).rows
    assert not DenseFfn(open_flash(out), 1, threshold=[0.1, 0.1]).rows


def test_convert_reports_the_kept_rows(mixed):
    _, _, out = mixed
    lines = native.report(json.loads((out / "manifest.json").read_text()))
    assert "FFN down rows kept as they are (down.bin): 1 Q4_K, 1 Q6_K" in lines
