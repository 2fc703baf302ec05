"""The forward pass against an f64 numpy transcription of llama.cpp's graph, run on the raw GGUF
tensors as gguf-py dequantizes them: no flashllm code on the reference side (no source reader, no
converter, no Q/K un-permutation: llama-arch GGUF Q/K are used as stored, with llama.cpp's
interleaved-pair RoPE; qwen2 uses rotate-half RoPE, as llama.cpp does).

This pins down what the llama.cpp comparison cannot: that comparison is limited by llama.cpp's own
8-bit activation rounding, this one is exact arithmetic on the same weights, so the tolerance is
f32 summation noise: max|ours - ref| / max|ref| < 1e-4 (measured ~4e-6 on smollm2).
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import gguf_path

pytestmark = pytest.mark.realmodel
TOKENS = np.random.default_rng(5).integers(0, 32000, size=24)   # (24,)


class GGUF:
    """Dequantized tensors and metadata of a GGUF file, read with gguf-py."""

    def __init__(self, path):
        from gguf import GGUFReader
        self.reader = GGUFReader(str(path))
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.meta("general.architecture")

    def meta(self, key):
        f = self.reader.fields.get(key)
        if f is None:
            return None
        val = f.parts[f.data[0]]
        return bytes(val).decode() if val.dtype == np.uint8 else val.tolist()[0]

    def hp(self, key):
        return self.meta(f"{self.arch}.{key}")

    def w(self, name) -> np.ndarray:
        from gguf.quants import dequantize
        t = self.tensors[name]
        shape = [int(n) for n in reversed(t.shape)]
        return dequantize(t.data, t.tensor_type).astype(np.float64).reshape(shape)


def rope(x: np.ndarray, theta: float, interleaved: bool) -> np.ndarray:
    """x (T, h, hd) at positions 0..T-1; pairs (2j, 2j+1) when interleaved, else (j, j + hd/2)."""
    T, _, hd = x.shape
    ang = np.arange(T)[:, None] * theta ** (-2.0 * np.arange(hd // 2) / hd)   # (T, hd/2)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]                  # (T, 1, hd/2)
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :hd // 2], x[..., hd // 2:])
    ra, rb = a * c - b * s, a * s + b * c
    out = np.empty_like(x)                                                    # (T, h, hd)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = ra, rb
    else:
        out[..., :hd // 2], out[..., hd // 2:] = ra, rb
    return out


def linear(g: GGUF, name: str, x: np.ndarray) -> np.ndarray:
    y = x @ g.w(name + ".weight").T
    return y + g.w(name + ".bias") if name + ".bias" in g.tensors else y


def reference_logits(g: GGUF, ids: np.ndarray) -> np.ndarray:
    """logits (T, vocab) of llama.cpp's llama/qwen2 graph in f64."""
    nh, nkv, eps = g.hp("attention.head_count"), g.hp("attention.head_count_kv"), \
        g.hp("attention.layer_norm_rms_epsilon")
    theta = g.hp("rope.freq_base") or 10000.0
    rms = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w   # noqa: E731
    x = g.w("token_embd.weight")[ids]                                          # (T, d)
    T, d = x.shape
    hd = d // nh
    mask = np.triu(np.full((T, T), -np.inf), 1)                                # (T, T)
    for i in range(g.hp("block_count")):
        p = f"blk.{i}."
        h = rms(x, g.w(p + "attn_norm.weight"))                                # (T, d)
        q = rope(linear(g, p + "attn_q", h).reshape(T, nh, hd), theta, g.arch == "llama")
        k = rope(linear(g, p + "attn_k", h).reshape(T, nkv, hd), theta, g.arch == "llama")
        v = linear(g, p + "attn_v", h).reshape(T, nkv, hd)                     # (T, nkv, hd)
        k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)  # (T, nh, hd)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask               # (nh, T, T)
        s = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("hts,shd->thd", s / s.sum(-1, keepdims=True), v).reshape(T, d)
        x = x + linear(g, p + "attn_output", o)
        h = rms(x, g.w(p + "ffn_norm.weight"))
        gate, up = linear(g, p + "ffn_gate", h), linear(g, p + "ffn_up", h)    # (T, n_ff)
        x = x + linear(g, p + "ffn_down", gate / (1 + np.exp(-gate)) * up)
    x = rms(x, g.w("output_norm.weight"))
    out = "output.weight" if "output.weight" in g.tensors else "token_embd.weight"
    return x @ g.w(out).T                                                      # (T, vocab)


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_forward_matches_numpy_graph_on_raw_gguf(real_model, name):
    ref = reference_logits(GGUF(gguf_path(name)), TOKENS)                                 # (T, vocab)
    net = real_model(name)
    net.reset()
    ours = net.forward(TOKENS, 0)                                              # (T, vocab)
    err = float(np.abs(ours - ref).max() / np.abs(ref).max())
    print(f"{name}: max relative error vs the f64 numpy graph {err:.2e}")
    assert err < 1e-4
    assert (ours.argmax(1) == ref.argmax(1)).all()
