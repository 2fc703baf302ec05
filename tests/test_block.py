"""A decode token through a block in one C call each for attention and FFN (native/block.c,
flashllm/ffi/block.py, Model._token_blocks) against the sequence of kernel calls model.py runs
otherwise, bit for bit: the tiny GGUFs of every RMSNorm architecture (biases, QK norms, sandwich
norms, GeGLU, sliding windows) converted natively, OLMoE's whole-projection QK norm, and
(realmodel) SmolLM2, the 0.5B and Gemma 3 with their packed and unpacked quantized matrices; f16
and f32 KV caches."""
from __future__ import annotations

import numpy as np
import pytest

from gguf_tiny import write_gguf
from test_parity_gguf_tiny import CASES
from test_parity_hf import PROMPT

from flashllm.convert.convert import convert
from flashllm.errors import KernelError
from flashllm.ffi.block import FfnToken
from flashllm.ffi.lib import ffi
from flashllm.ffi.moe import MoeToken
from flashllm.format.reader import open_flash
from flashllm.runtime.model import Model


def decode(net: Model, prompt, steps: int) -> list[np.ndarray]:
    """Logits (1, vocab) of `steps` greedy one-token passes after the prompt's prefill."""
    net.reset()
    logits = net.forward(np.asarray(prompt), 0, last_only=True)         # (1, vocab)
    out, pos = [], len(prompt)
    for _ in range(steps):
        logits = net.forward(np.array([int(np.argmax(logits[-1]))]), pos)  # (1, vocab)
        out.append(logits)
        pos += 1
    return out


def both_ways(flash, kv: str, steps: int = 10, prompt=PROMPT[:8]):
    """(blocks used by the C path, its logits, the kernel-call sequence's logits)."""
    fast, slow = (Model(flash, n_threads=2, n_ctx=64, kv_dtype=kv) for _ in range(2))
    slow.token_blocks = False                                        # model.py's own sequence
    got = decode(fast, prompt, steps)
    return fast._blocks, got, decode(slow, prompt, steps)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "phi3", "gemma3", "gemma3_softcap"])
@pytest.mark.parametrize("kv", ["f16", "f32"])
def test_tiny_native_blocks_give_the_kernel_sequence_bits(hf_tiny, tmp_path, name, kv):
    _, hf = hf_tiny(name)
    path = write_gguf(hf, tmp_path / f"{name}.gguf", CASES[name])
    flash = open_flash(convert(path, tmp_path / "m", "native"))
    blocks, got, want = both_ways(flash, kv)
    assert all(f is not None for _, f in blocks)                     # every FFN ran in C
    assert all(a is not None for a, _ in blocks)                     # and every attention, its
    fused = flash.config.n_heads * flash.config.head_dim % 16 == 0 and \
        flash.config.n_kv_heads * flash.config.head_dim % 16 == 0    # q / k / v fused or three
    assert all((a.c.k.w == ffi.NULL) == fused for a, _ in blocks)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.realmodel
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma-3-270m"])
def test_real_native_blocks_give_the_kernel_sequence_bits(name):
    from conftest import _converted
    flash = open_flash(_converted(name, "native", log=print))
    blocks, got, want = both_ways(flash, "f16", steps=6, prompt=list(range(100, 116)))
    assert all(a is not None and f is not None for a, f in blocks)   # Gemma's q8_0 / q5_0 v too
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_moe_attention_normed_whole_gives_the_kernel_sequence_bits(tmp_path):
    """OLMoE's QK norm over the whole q and k (scripts/fixtures/make_moe_gguf.py's small
    fixture): its attention runs in C too, and its experts' layer (fl_moe_token: the norm,
    router and routing in C too, against model.py's calls)."""
    from scripts.fixtures.make_moe_gguf import SMALL, write as write_moe
    gguf = write_moe(tmp_path / "m.gguf", "q4_0", shape=SMALL, log=lambda m: None)
    flash = open_flash(convert(gguf, tmp_path / "m", None))
    assert flash.config.qk_norm_full
    for kv in ("f16", "f32"):
        blocks, got, want = both_ways(flash, kv, prompt=list(range(40, 48)))
        assert all(a is not None and isinstance(f, MoeToken) for a, f in blocks)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_a_block_checks_its_vectors(hf_tiny, tmp_path):
    _, hf = hf_tiny("llama")
    flash = open_flash(convert(write_gguf(hf, tmp_path / "l.gguf", "llama"), tmp_path / "m", "native"))
    ffn = Model(flash, n_threads=1, n_ctx=16).ffn
    d = flash.config.d_model
    with pytest.raises(KernelError, match=r"norm must be a contiguous float32 \(64,\) array"):
        FfnToken(np.ones(d, np.float64), ffn.gate_up[0], ffn.down[0], "silu", True, 1e-5)
    block = FfnToken(np.ones(d, np.float32), ffn.gate_up[0], ffn.down[0], "silu", True, 1e-5)
    with pytest.raises(KernelError, match=r"x must be a writable contiguous float32 \(1, 64\)"):
        block(np.zeros((2, d), np.float32), 1)
