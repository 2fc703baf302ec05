"""Parity with transformers on tiny random-initialized checkpoints of every supported architecture.

Relative error is max|ours - ref| / max|ref| over all logits of the prompt.

- f32: ours vs transformers directly; < 1e-3 (both are f32; what is left is summation order).
- f16 / q8_0: the reference is transformers with each 2-D weight rounded to f16 or q8_0 by the
  numpy round trip below (written from ggml's definition), along the axis flashllm stores it (FFN
  down by columns, being the down part of each neuron's bundle). The kernels compute in f32 on
  the dequantized weights (activations are not quantized), so what is left is summation order:
  1e-4 (measured ~5e-7). Against the unrounded model the gap is the weights' own rounding error
  carried through the network: f16 rounds to 2^-11 relative (measured 3e-4..7e-4 on logits) →
  3e-3; q8_0 has ~0.5% rms weight error (amax/127 steps over N(0,1) blocks; measured 7e-3..1.7e-2)
  → 5e-2. Both still catch a wrong rounding axis or scale (those are off by whole percents).
- q4_1: the checkpoint is first put on q4_1 grids (gguf-py's reference Q4_1 round trip along the
  storage axis) and written out; converting it at q4_1 must give those grids back (the step
  search reproduces a 16-level grid), so exact=True matches transformers on that checkpoint like
  f32 does (1e-4). The int8 path adds the activations' rounding: 5e-2 as for q8_0.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from hf_tiny import TINY, TINY_MOE, VOCAB

from flashllm.format.reader import open_flash
from flashllm.convert.convert import convert
from flashllm.generation.generate import generate
from flashllm.runtime.model import Model
from flashllm.generation.sampler import Sampler, SamplerParams

PROMPT = np.random.default_rng(99).integers(3, VOCAB, size=32).astype(np.int64)   # (32,)
ARCHS = list(TINY)
TOL_VS_ROUNDED = {"f32": 1e-4, "f16": 1e-4, "q8_0": 1e-4}
TOL_VS_ORIGINAL = {"f32": 1e-3, "f16": 3e-3, "q8_0": 5e-2}
MOE_FLIPS = 3
ROUTERS = ("mlp.gate.weight", "shared_expert_gate.weight")   # MoE routers and the shared gate


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def assert_close(ours: np.ndarray, ref: np.ndarray, tol: float, name: str) -> None:
    """rel_err < tol; for a mixture of experts against a reference whose weights or activations
    were rounded differently, a router may pick another expert for a token whose top-k was
    nearly tied (a jump, not a drift): there at most MOE_FLIPS of the positions may exceed tol
    (measured: 0-2 of 32) and the median position must stay below it."""
    if name not in TINY_MOE:
        assert rel_err(ours, ref) < tol
        return
    per = np.abs(ours - ref).max(axis=1) / np.abs(ref).max()            # (T,)
    assert (per >= tol).sum() <= MOE_FLIPS and np.median(per) < tol, (per.max(), np.median(per))


def round_q8_0(w: np.ndarray) -> np.ndarray:
    """ggml q8_0 round trip of rows w (rows, cols): per 32 values d = amax/127 stored as f16,
    q = round(x / d), x' = f16(d) * q."""
    blocks = w.reshape(w.shape[0], -1, 32).astype(np.float32)          # (rows, cols/32, 32)
    d = np.abs(blocks).max(axis=2, keepdims=True) / 127.0              # (rows, cols/32, 1)
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.sign(blocks) * np.floor(np.abs(blocks * inv) + 0.5), -127, 127)
    return (d.astype(np.float16).astype(np.float32) * q).reshape(w.shape)


def round_q4_1(w: np.ndarray) -> np.ndarray:
    """gguf-py's reference Q4_1 round trip of rows w (rows, cols): d = (max - min) / 15, m = min."""
    from gguf import GGMLQuantizationType as GQ
    from gguf.quants import dequantize, quantize
    return dequantize(quantize(w.astype(np.float32), GQ.Q4_1), GQ.Q4_1).reshape(w.shape)


def round_weight(w: np.ndarray, dtype: str, by_columns: bool) -> np.ndarray:
    if by_columns:
        return round_weight(w.T, dtype, False).T
    if dtype == "f32":
        return w
    if dtype == "q8_0" and w.shape[1] % 32 == 0:
        return round_q8_0(w)
    if dtype == "q4_1" and w.shape[1] % 32 == 0:
        return round_q4_1(w)
    return w.astype(np.float16).astype(np.float32)   # f16, and quantized rows that do not block


def rounded_reference(model, dtype: str):
    """A copy of the transformers model whose 2-D weights went through the storage rounding."""
    import copy
    import torch
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(ROUTERS):
                continue                                   # stored f32, as llama.cpp keeps them
            by_cols = name.endswith(("down_proj.weight", "fc2.weight", "experts.down_proj"))
            if p.ndim == 2:
                p.copy_(torch.from_numpy(round_weight(p.numpy(), dtype, by_cols)))
            elif p.ndim == 3:                              # stacked experts (n_experts, out, in)
                p.copy_(torch.from_numpy(np.stack([round_weight(w, dtype, by_cols)
                                                   for w in p.numpy()])))
    return ref


def hf_logits(model, ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.as_tensor(ids).reshape(1, -1)).logits[0].float().numpy()   # (T, vocab)


@pytest.fixture(scope="module")
def flash_model(hf_tiny, tmp_path_factory):
    """load(name, dtype, exact=True) -> (Model, transformers model), converted once per (name,
    dtype). exact: q4_0 / q8_0 weights meet f32 activations (the default Model quantizes them to
    int8, as llama.cpp does; test_quantized_logits checks that one too)."""
    folders, built = {}, {}

    def load(name: str, dtype: str, exact: bool = True):
        if (name, dtype) not in folders:
            folder, hf = hf_tiny(name)
            out = convert(folder, tmp_path_factory.mktemp(f"{name}_{dtype}") / "m", dtype)
            folders[name, dtype] = (out, hf)
        if (name, dtype, exact) not in built:
            out, hf = folders[name, dtype]
            net = Model(open_flash(out), n_threads=2, n_ctx=128, exact=exact)
            built[name, dtype, exact] = (net, hf)
        return built[name, dtype, exact]

    return load


@pytest.mark.parametrize("name", ARCHS)
def test_f32_logits_match_transformers(flash_model, name):
    net, hf = flash_model(name, "f32")
    ref = hf_logits(hf, PROMPT)                                              # (32, vocab)
    assert rel_err(net.forward(PROMPT, 0), ref) < 1e-3


@pytest.mark.parametrize("name", ARCHS)
def test_prefill_then_decode_matches_one_pass(flash_model, name):
    """KV cache path: 16 tokens prefilled, then 16 decoded one by one, against transformers."""
    net, hf = flash_model(name, "f32")
    net.reset()
    ref = hf_logits(hf, PROMPT)                                              # (32, vocab)
    rows = [net.forward(PROMPT[:16], 0)] + [net.forward(PROMPT[p:p + 1], p) for p in range(16, 32)]
    assert rel_err(np.concatenate(rows), ref) < 1e-3


@pytest.mark.parametrize("name", ARCHS)
def test_f16_kv_cache_prefill_then_decode_against_transformers(hf_tiny, tmp_path, name):
    """`run`'s f16 keys/values (as llama.cpp keeps them): 16 tokens prefilled, 16 decoded, against
    transformers in f32; f16 rounding of K and V (2^-11 relative) is all that separates them."""
    folder, hf = hf_tiny(name)
    net = Model(open_flash(convert(folder, tmp_path / "m", "f32")), n_threads=2, n_ctx=128,
                kv_dtype="f16")
    assert net.k_cache.dtype == net.v_cache.dtype == np.float16
    ref = hf_logits(hf, PROMPT)                                              # (32, vocab)
    rows = [net.forward(PROMPT[:16], 0)] + [net.forward(PROMPT[p:p + 1], p) for p in range(16, 32)]
    err = rel_err(np.concatenate(rows), ref)
    print(f"{name}, f16 KV: logits vs transformers {err:.2e}")
    assert err < 1e-3


@pytest.mark.parametrize("name", ARCHS)
def test_greedy_32_tokens_match_transformers(flash_model, name):
    """32 tokens, EOS included: generate() here does not stop at EOS, so transformers must
    neither stop nor mask it (min_new_tokens would pick the runner-up where EOS is greedy)."""
    import torch
    net, hf = flash_model(name, "f32")
    net.reset()
    prompt = PROMPT[:8]
    eos, hf.generation_config.eos_token_id = hf.generation_config.eos_token_id, None
    try:
        with torch.no_grad():
            seq = hf.generate(torch.as_tensor(prompt).reshape(1, -1), do_sample=False,
                              max_new_tokens=32, pad_token_id=0)
    finally:
        hf.generation_config.eos_token_id = eos
    want = seq[0, len(prompt):].tolist()
    got = []
    generate(net, Sampler(SamplerParams(temp=0.0)), prompt.tolist(), 32, on_token=got.append)
    assert got == want


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("name", ARCHS)
def test_quantized_logits(flash_model, name, dtype):
    net, hf = flash_model(name, dtype)
    ours = net.forward(PROMPT, 0)                                            # (32, vocab)
    assert rel_err(ours, hf_logits(rounded_reference(hf, dtype), PROMPT)) < TOL_VS_ROUNDED[dtype]
    assert_close(ours, hf_logits(hf, PROMPT), TOL_VS_ORIGINAL[dtype], name)
    fast, _ = flash_model(name, dtype, exact=False)        # int8 activations for q8_0
    out = fast.forward(PROMPT, 0)
    print(f"{name} {dtype}, exact=False: logits vs transformers {rel_err(out, hf_logits(hf, PROMPT)):.2e}")
    assert_close(out, hf_logits(hf, PROMPT), TOL_VS_ORIGINAL[dtype], name)


@pytest.mark.parametrize("name", ARCHS)
def test_q4_1_grids_come_back(hf_tiny, tmp_path, name):
    folder, hf = hf_tiny(name)
    on_grid = rounded_reference(hf, "q4_1")
    src = tmp_path / "src"
    shutil.copytree(folder, src)
    on_grid.save_pretrained(str(src), safe_serialization=True)
    out = convert(src, tmp_path / "m", "q4_1")
    ref = hf_logits(on_grid, PROMPT)                                         # (32, vocab)
    for exact, tol in ((True, 1e-4), (False, 5e-2)):
        net = Model(open_flash(out), n_threads=2, n_ctx=128, exact=exact)
        logits = net.forward(PROMPT, 0)                                      # (32, vocab)
        print(f"{name} q4_1, exact={exact}: logits vs transformers on q4_1 grids "
              f"{rel_err(logits, ref):.2e}")
        assert_close(logits, ref, tol, name)


def test_running_past_the_context_is_a_clear_error(flash_model):
    from flashllm.runtime.model import ContextError
    net, _ = flash_model("llama", "f32")
    with pytest.raises(ContextError, match="context holds 128"):
        net.forward(PROMPT, 100)
    with pytest.raises(ContextError, match="outside the vocabulary"):
        net.forward(np.array([VOCAB]), 0)


def test_learned_positions_end_the_context(hf_tiny, tmp_path):
    """OPT's position table has context_length rows (128 here): a Model asked for more holds
    that many and a pass past them is a ContextError that says so (it was an index error from
    the kernel); `run` refuses a prompt + -n past them in one line, `perplexity` a longer --ctx,
    and `calibrate` runs its passes at that length (its default --ctx is 512)."""
    from typer.testing import CliRunner
    from flashllm.cli import app
    from flashllm.runtime.model import ContextError
    folder, _ = hf_tiny("opt")
    out = convert(folder, tmp_path / "m", "f32")
    net = Model(open_flash(out), n_ctx=512)
    assert net.n_ctx == 128
    with pytest.raises(ContextError, match="the context holds 128 .the model's learned positions"):
        net.forward(PROMPT, 120)
    r = CliRunner().invoke(app, ["run", str(out), "-p", "w5 w6", "-n", "200"])
    assert r.exit_code == 1 and r.output.strip() == (
        "error: prompt (2 tokens) + --n-predict 200 exceed the model's 128 positions (learned "
        "position embeddings)")
    r = CliRunner().invoke(app, ["perplexity", str(out)])
    assert r.exit_code == 1 and "--ctx 512 is more than the model's 128 positions" in r.output
    r = CliRunner().invoke(app, ["calibrate", str(out), "--tokens", "300", "-t", "1",
                                 "--predictor", "none"])
    assert r.exit_code == 0 and "passes of 128 tokens" in r.output, r.output
