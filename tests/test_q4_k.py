"""q4_k: ggml Q4_K gate / up rows and q4_1 down columns in one bundle (docs/FORMAT.md).

The independent reference for Q4_K is gguf-py's `dequantize(..., Q4_K)` and numpy. The kernels
are checked on every instruction set test_kernel_isa.py covers: native/*.c are built into a shared
object per ISA and called through cffi's ABI mode (the extension itself is built for this CPU
only), against numpy on the dequantized weights (the int8 paths on the same int8-quantized x the
kernel makes: d = amax / 127 per 256-value superblock, q = nearest-even). The converter: a small
Q4_K GGUF written here, and the real Qwen2.5-Coder-1.5B Q4_K_M GGUF (its first two layers, when
the file is available).
"""
import dataclasses
import functools
import subprocess
import sys
import tempfile
from pathlib import Path

import cffi
import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from flashllm.ffi import kernel
from flashllm.format.reader import open_flash
from flashllm.convert.convert import convert, convert_source
from flashllm.errors import KernelError, SourceError
from flashllm.ffi.quant import dequantize_rows, quantize_rows
from flashllm.convert.sources import open_source
from flashllm.convert.sources.base import Source
from flashllm.model.tensor import QTensor, row_bytes
from test_kernel_isa import ISAS, isa_compiler

ROOT = Path(__file__).resolve().parent.parent
D, FF = 512, 48  # d_model (2 superblocks), neurons


def q4k_rows(rng, rows: int, cols: int) -> np.ndarray:
    """(rows, cols / 256 * 144) uint8: random Q4_K blocks (every scale / min / nibble pattern),
    positive f16 d and dmin of realistic size."""
    nb = cols // 256
    blk = rng.integers(0, 256, (rows, nb, 144), dtype=np.uint8)  # (rows, nb, 144)
    for at, lo, hi in ((0, 5e-4, 2e-3), (2, 1e-3, 4e-3)):       # d, dmin
        f = rng.uniform(lo, hi, (rows, nb)).astype(np.float16)   # (rows, nb)
        blk[..., at:at + 2] = f.view(np.uint8).reshape(rows, nb, 2)
    return blk.reshape(rows, nb * 144)


def ref_q4k(data: np.ndarray, cols: int) -> np.ndarray:
    return dequantize(data, Q.Q4_K).reshape(data.shape[0], cols)  # (rows, cols) f32


def int8_x(x: np.ndarray) -> np.ndarray:
    """x (T, n) as the kernel's int8 activations for q4_k see it, f64: d * nearest-even(x / d)
    with one d = amax / 127 per 256-value superblock (as ggml's q8_K)."""
    xb = x.reshape(x.shape[0], -1, 256)                                    # (T, n/256, 256)
    d = (np.abs(xb).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    return (np.rint(xb * inv) * d).reshape(x.shape).astype(np.float64)


def silu(v):
    return v / (1.0 + np.exp(-v))


@pytest.fixture(scope="module")
def bundle_case():
    """A layer of FF q4_k bundles (FF, stride) and its f64 gate, up (FF, D) and down (FF, D)."""
    rng = np.random.default_rng(5)
    gate, up = q4k_rows(rng, FF, D), q4k_rows(rng, FF, D)                 # (FF, 288) each
    down = quantize_rows(rng.standard_normal((FF, D)).astype(np.float32) * 0.05, "q4_1")  # (FF, 320)
    stride = 2 * row_bytes("q4_k", D) + row_bytes("q4_1", D)
    assert stride == 896 and stride % 32 == 0
    bundles = np.ascontiguousarray(np.concatenate([gate, up, down], axis=1))  # (FF, 896)
    ref = [ref_q4k(gate, D), ref_q4k(up, D), dequantize(down, Q.Q4_1).reshape(FF, D)]
    return bundles, [r.astype(np.float64) for r in ref]


def ffn_ref(x, g, u, dn, rows=None):
    """y (T, D) f64 = sum over kept neurons of silu(g . x) * (u . x) * down."""
    h = silu(x @ g.T) * (x @ u.T)                                          # (T, FF)
    if rows is not None:
        mask = np.zeros(g.shape[0], bool)
        mask[rows] = True
        h = h * mask
    return h @ dn


def test_row_bytes_and_dequantize_equal_gguf_py():
    assert row_bytes("q4_k", 1536) == 864
    with pytest.raises(KernelError):
        row_bytes("q4_k", 288)
    data = q4k_rows(np.random.default_rng(1), 7, 768)                       # (7, 432)
    np.testing.assert_array_equal(dequantize_rows(data, "q4_k", 768), ref_q4k(data, 768))
    with pytest.raises(KernelError):   # the quantizer (tests/test_kquant.py) takes whole superblocks
        quantize_rows(np.zeros((1, 288), np.float32), "q4_k")


@pytest.mark.parametrize("T", [1, 2, 4, 5, 13])
def test_ffn_bundles_against_numpy(bundle_case, T):
    bundles, (g, u, dn) = bundle_case
    x = np.random.default_rng(T).standard_normal((T, D)).astype(np.float32)  # (T, D)
    ref = ffn_ref(int8_x(x), g, u, dn)
    for threads in (1, 2):
        y = np.zeros((T, D), np.float32)
        kernel.ffn_bundles(bundles, "q4_k", D, True, "silu", x, y, n_threads=threads)
        assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    y = np.zeros((T, D), np.float32)
    kernel.ffn_bundles(bundles, "q4_k", D, True, "silu", x, y, exact=True)
    ref = ffn_ref(x.astype(np.float64), g, u, dn)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    rows = np.arange(1, FF, 3, dtype=np.int32)                             # (15,) gathered slots
    y = np.zeros((T, D), np.float32)
    kernel.ffn_bundles(bundles, "q4_k", D, True, "silu", x, y, rows=rows)
    ref = ffn_ref(int8_x(x), g, u, dn, rows)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()


def test_a_few_tokens_at_once_are_each_computed_as_one(bundle_case):
    """T <= 5 tokens (a decode pass with guesses): each token's FFN bit for bit its own pass's."""
    bundles, _ = bundle_case
    x = np.random.default_rng(8).standard_normal((4, D)).astype(np.float32)  # (4, D)
    for threads in (1, 2):
        one = np.zeros((4, D), np.float32)
        for t in range(4):
            kernel.ffn_bundles(bundles, "q4_k", D, True, "silu", x[t:t + 1], one[t:t + 1],
                               threshold=0.05, n_threads=threads)
        many = np.zeros((4, D), np.float32)
        kernel.ffn_bundles(bundles, "q4_k", D, True, "silu", x, many, threshold=0.05,
                           n_threads=threads)
        np.testing.assert_array_equal(many, one)


@pytest.mark.parametrize("T", [1, 3, 9])
def test_matmul_against_numpy(T):
    w = q4k_rows(np.random.default_rng(9), 40, D)                          # (40, 288)
    x = np.random.default_rng(10 + T).standard_normal((T, D)).astype(np.float32)
    y = kernel.matmul(QTensor(w, "q4_k", 40, D), x)                        # (T, 40)
    ref = int8_x(x) @ ref_q4k(w, D).T.astype(np.float64)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()


# ---- every instruction set ----------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _isa_lib(isa: str):
    """native/*.c built for isa and loaded through cffi's ABI mode, once per session: the library
    stays loaded to the end (its worker threads outlive any call, so an unloaded library would
    crash them; a per-test library freed by the garbage collector did)."""
    cc = isa_compiler(isa)
    so = Path(tempfile.mkdtemp(prefix=f"flashllm-{isa}-")) / f"flashllm_{isa}.so"
    subprocess.run([cc, "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-D_GNU_SOURCE",
                    "-fopenmp", "-shared", "-fPIC", "-Inative", *ISAS[isa],
                    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "native").glob("*.c")),
                    "-lm", "-lpthread", "-o", str(so)], cwd=ROOT, check=True)
    header = (ROOT / "native" / "flashllm.h").read_text()
    ffi = cffi.FFI()
    ffi.cdef(header[header.index("/* CDEF-BEGIN */") + 16:header.index("/* CDEF-END */")])
    return ffi, ffi.dlopen(str(so))


@pytest.mark.parametrize("isa", list(ISAS))
def test_kernels_on_every_instruction_set(isa, bundle_case):
    ffi, lib = _isa_lib(isa)
    f32 = lambda a: ffi.cast("float *", ffi.from_buffer(a))  # noqa: E731
    bundles, (g, u, dn) = bundle_case
    out = np.zeros(D * 2, np.float32)
    assert lib.fl_dequantize_row(5, ffi.from_buffer(bundles[0, :576]), f32(out), 2 * D) == 0
    np.testing.assert_array_equal(out.reshape(2, D), np.stack([g[0], u[0]]).astype(np.float32))
    w = np.ascontiguousarray(bundles[:, :288])                              # (FF, 288) gate rows
    for T in (1, 2, 4, 5, 13):
        x = np.random.default_rng(T).standard_normal((T, D)).astype(np.float32)
        for exact in (0, 1):
            xr = x.astype(np.float64) if exact else int8_x(x)
            y = np.zeros((T, D), np.float32)
            layer = ffi.new("fl_ffn_layer *", {"bundles": ffi.from_buffer(bundles), "n": FF,
                                               "stride": bundles.shape[1], "dtype": 5,
                                               "down_dtype": 4, "d": D,
                                               "glu": 1, "act": 0})
            assert lib.fl_ffn_bundles(layer, ffi.NULL, 0, 0.0, f32(x), T, f32(y), exact, 2) == 0
            ref = ffn_ref(xr, g, u, dn)
            assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max(), (isa, T, exact)
            y = np.zeros((T, FF), np.float32)
            assert lib.fl_matmul(ffi.from_buffer(w), 5, FF, D, ffi.NULL, f32(x), T, f32(y),
                                 exact, 1) == 0
            ref = xr @ g.T
            assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max(), (isa, T, exact)


# ---- the converter ------------------------------------------------------------------------

def write_q4k_gguf(path: Path, rng, d: int = 256, gate_type=Q.Q4_K) -> dict:
    """A 2-layer llama GGUF (d_model d, 4 heads, FF neurons) with Q4_K gate / up (or gate_type
    for the gate), f32 down and the rest; returns the stored gate / up bytes and down f32."""
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in ((w.add_block_count, 2), (w.add_context_length, 64), (w.add_embedding_length, d),
                   (w.add_feed_forward_length, FF), (w.add_head_count, 4), (w.add_head_count_kv, 2),
                   (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0),
                   (w.add_eos_token_id, 3)):
        add(v)
    hd = d // 4
    f32 = {"token_embd.weight": (40, d), "output_norm.weight": (d,), "output.weight": (40, d)}
    stored = {}
    for i in range(2):
        f32.update({f"blk.{i}.attn_norm.weight": (d,), f"blk.{i}.ffn_norm.weight": (d,),
                    f"blk.{i}.attn_q.weight": (d, d), f"blk.{i}.attn_k.weight": (2 * hd, d),
                    f"blk.{i}.attn_v.weight": (2 * hd, d), f"blk.{i}.attn_output.weight": (d, d),
                    f"blk.{i}.ffn_down.weight": (d, FF)})
    for name, shape in f32.items():
        v = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        w.add_tensor(name, v)
        stored[name] = v
    for i in range(2):
        for part in ("gate", "up"):
            name = f"blk.{i}.ffn_{part}.weight"
            qtype = gate_type if part == "gate" else Q.Q4_K
            if qtype == Q.Q4_K:
                raw = q4k_rows(rng, FF, d)                                 # (FF, d / 256 * 144)
            else:
                raw = gguf.quants.quantize(rng.standard_normal((FF, d)).astype(np.float32), qtype)
            w.add_tensor(name, raw, raw_dtype=qtype)
            stored[name] = raw
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def test_convert_copies_q4k_blocks(tmp_path):
    stored = write_q4k_gguf(tmp_path / "m.gguf", np.random.default_rng(3))
    flash = open_flash(convert(tmp_path / "m.gguf", tmp_path / "out", "q4_k"))
    f = flash.ffn
    assert (flash.dtype, f.dtype, f.part_bytes, f.stride) == ("q4_k", "q4_k", 144, 2 * 144 + 160)
    assert flash.manifest["ffn"]["dtype"] == "q4_k"
    dense = {t["name"]: t["dtype"] for t in flash.manifest["dense"]["tensors"]}
    assert dense["blk.0.attn_q.weight"] == dense["token_embd.weight"] == "q4_1"
    for layer in range(2):
        b = flash.read_ffn_layer(layer)                                    # (FF, stride)
        np.testing.assert_array_equal(b[:, :144], stored[f"blk.{layer}.ffn_gate.weight"])
        np.testing.assert_array_equal(b[:, 144:288], stored[f"blk.{layer}.ffn_up.weight"])
        down = stored[f"blk.{layer}.ffn_down.weight"].T                    # (FF, d)
        np.testing.assert_array_equal(b[:, 288:448], quantize_rows(down, "q4_1"))
        assert not b[:, 448:].any()


def test_convert_refuses_a_source_without_q4k(tmp_path):
    write_q4k_gguf(tmp_path / "m.gguf", np.random.default_rng(4), gate_type=Q.Q8_0)
    with pytest.raises(SourceError, match=r"--dtype q4_k copies Q4_K gate / up blocks, but "
                                          r"blk\.0\.ffn_gate\.weight is Q8_0"):
        convert(tmp_path / "m.gguf", tmp_path / "out", "q4_k")
    assert not (tmp_path / "out").exists()
    run = subprocess.run([sys.executable, "-m", "flashllm", "convert", str(tmp_path / "m.gguf"),
                          "-o", str(tmp_path / "out"), "--dtype", "q4_k"],
                         capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert run.returncode != 0 and len(lines) == 1 and "is Q8_0 (use --dtype q4_1)" in lines[0]


def test_convert_refuses_d_model_not_a_multiple_of_256(tmp_path):
    write_q4k_gguf(tmp_path / "m.gguf", np.random.default_rng(5), d=512 + 32, gate_type=Q.Q8_0)
    with pytest.raises(SourceError, match="--dtype q4_k needs d_model a multiple of 256, this "
                                          "model has 544"):
        convert(tmp_path / "m.gguf", tmp_path / "out", "q4_k")


# ---- the real Q4_K_M model ----------------------------------------------------------------

class FirstLayers(Source):
    """A GGUF source cut to its first n_layers layers and vocab tokens (a small real model)."""

    def __init__(self, src, n_layers: int, vocab: int):
        self.src, self.vocab = src, vocab
        self.config = dataclasses.replace(src.config, n_layers=n_layers, vocab_size=vocab,
                                          bos_token_id=None, eos_token_ids=(0,))
        self.tokenizer_json, self.chat_template = None, None
        keep = lambda n: not n.startswith("blk.") or int(n.split(".")[1]) < n_layers  # noqa: E731
        self.names = [n for n in src.tensor_names() if keep(n)]

    def tensor_names(self):
        return self.names

    def tensor_nbytes(self, name):
        return 4 * int(np.prod(self.tensor_shape(name)))

    def tensor_shape(self, name):
        shape = self.src.tensor_shape(name)
        return (self.vocab, *shape[1:]) if name in ("token_embd.weight", "output.weight") else shape

    def stored_type(self, name):
        return self.src.stored_type(name)

    def load_blocks(self, name):
        return self.src.load_blocks(name)

    def load(self, name):
        if name in ("token_embd.weight", "output.weight"):
            blocks = self.src.load_blocks(name)[:self.vocab]          # (vocab, bytes per row)
            kind = Q[self.src.stored_type(name)]
            return dequantize(blocks, kind).reshape(self.vocab, -1)
        return self.src.load(name)

    def close(self):
        pass


@pytest.fixture(scope="module")
def qwen15_two_layers(tmp_path_factory):
    """(source, q4_k folder, q4_1 folder) of the 1.5B's first 2 layers and 512 tokens."""
    from conftest import gguf_path
    try:
        path = gguf_path("qwen2.5-coder-1.5b", log=lambda m: None)
    except Exception as e:   # no cached copy and no registry reachable
        pytest.skip(f"Qwen2.5-Coder-1.5B unavailable: {e}")
    tmp = tmp_path_factory.mktemp("qwen15")
    with open_source(path) as src:
        cut = FirstLayers(src, 2, 512)
        yield (cut, convert_source(cut, tmp / "q4_k", "q4_k"),
               convert_source(cut, tmp / "q4_1", "q4_1"))


def test_real_q4k_gguf_blocks_are_copied(qwen15_two_layers):
    src, q4k, _ = qwen15_two_layers
    flash = open_flash(q4k, verify=True)
    assert (flash.ffn.part_bytes, flash.ffn.stride) == (864, 2 * 864 + 960)
    for layer in range(2):
        b = flash.read_ffn_layer(layer)                                    # (8960, 2688)
        for k, part in enumerate(("gate", "up")):
            name = f"blk.{layer}.ffn_{part}.weight"
            assert src.stored_type(name) == "Q4_K"
            np.testing.assert_array_equal(b[:, 864 * k:864 * (k + 1)], src.load_blocks(name))


def test_real_q4k_model_matches_its_q4_1_conversion(qwen15_two_layers):
    """Both store gate / up exactly up to q4_1's f16 rounding of d * sc_j and dmin * m_j (gate
    values differ by 6.6e-4 of their mean size); the down columns and dense tensors are the same
    q4_1 bytes. In f32 (exact) the logits differ by 3.2e-4 of their largest; on int8 activations
    by 7.9e-3, the size of either model's own int8 error against its f32 run (8.6e-3 / 9.6e-3):
    a rounding flip of an int8 block is not small next to 1e-3, so the bar is on the f32 runs."""
    from flashllm.runtime.model import Model
    _, q4k, q41 = qwen15_two_layers
    tokens = np.array([17, 300, 5, 42, 99, 511, 7, 260], np.int32)          # (8,)
    out = []
    for path in (q4k, q41):
        flash = open_flash(path)
        out.append(Model(flash, n_threads=1, n_ctx=32, exact=True).forward(tokens, 0))  # (8, 512)
    a, b = out
    assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max()
