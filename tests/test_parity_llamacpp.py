"""Parity with llama.cpp on the real GGUF models, converted at f32 (exact dequantization of the
GGUF weights), against the fixtures of scripts/fixtures/make_llamacpp_fixtures.py (format
documented there).

llama.cpp multiplies quantized weights by 8-bit-quantized activations (and keeps an f16 KV cache),
flashllm computes in f32 on the exactly dequantized weights. Measured on smollm2-135m, "prose":
flashllm is within 8e-5 of an f64 numpy forward pass over the raw GGUF tensors, while llama.cpp's
top-16 logits sit up to 0.84 away from that exact computation (a per-position shift of up to
~0.25 plus ~0.1 std spread), and every top-1 disagreement between llama.cpp and the exact result
is at a top-2 margin below 0.15 in one of them. On gemma-3-270m (Q4_K_M) llama.cpp disagrees with
itself as much: its logits of the teacher-forced prompts fed one token per eval (its decode path)
agree with its one-batch fixture at 186 of 192 positions (all 161 clear ones), mean |log-prob
difference| 0.13 at the top 16 (docs/history/2026-11-24-conversion-studies.md, Gemma-3-270M). Hence a decision is
compared only where llama.cpp's top-2 margin is at least NEAR_TIE (0.25, above the largest margin
swing seen):
- teacher forcing: top-1 agreement >= 99% over 3 prompts x 64 positions, counting positions that
  are not near ties (all positions' agreement is printed);
- greedy: tokens identical up to the first step whose llama.cpp top-2 margin is below NEAR_TIE
  (past it the two continuations may legitimately part; where they part is printed);
- logits: our log-probabilities (logit - logsumexp, removing the common shift) at llama.cpp's
  top-16 ids within LOGPROB_TOL of llama.cpp's (the max difference is printed).

The NAME-f32 fixtures remove llama.cpp's rounding: they come from llama.cpp running an F32
re-export of the same GGUF (every tensor dequantized by gguf-py,
scripts/fixtures/make_f32_gguf.py) with an F32 KV cache, so both sides compute in f32 on
identical weights and the issue's bars apply to ALL positions, with no near-tie exemption in
teacher forcing:
- teacher forcing: top-1 agreement >= 99% over 3 prompts x 64 positions;
- logits: raw logits at llama.cpp's top-16 ids within F32_LOGIT_TOL (per model, see there);
- greedy: tokens identical up to the first step whose llama.cpp top-2 margin is below
  twice the logit tolerance (below it the two f32 computations may order the top
  two either way).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import gguf_path
from flashllm.generation.generate import generate
from flashllm.generation.sampler import Sampler, SamplerParams

FIXTURES = Path(__file__).parent / "fixtures" / "llamacpp"
MODELS = ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma-3-270m"]
PROMPTS = ["prose", "code", "chat"]
NEAR_TIE = 0.25       # logits (see above)
NATIVE_NEAR_TIE = 0.5  # the native conversions' int8 runs: llama.cpp's own int8 logits move with
                       # the CPU's kernels — on an AVX2-only EPYC its SmolLM2 fixture position
                       # "code" 63 (margin 0.31 on the AVX-512 machine that made it) flips by 0.46
LOGPROB_TOL = 1.5     # measured max 0.88 (smollm2, Q4_1), 1.36 (gemma-3-270m, Q4_K_M: llama.cpp's
                      # int8 activations in its Q4_K/Q5_0/Q6_K dots, f16 KV, f16 GELU table); a
                      # wrong layer or RoPE gives several units
NATIVE_LOGPROB_TOL = 2.5  # native conversions, int8 activations on both sides, past the first
                          # position: measured max 1.53 (gemma-3-270m), 0.39 (0.5B), 2.05 (1.5B)
# f32 vs f32: measured max 4.4e-4 (smollm2) and 1.5e-4 (qwen), both at position 0, f32 summation
# order noise; llama.cpp with only its KV cache in f16 instead of f32 already moves these logits by
# 2.7e-2 (smollm2) and 1.5e-2 (qwen), so 5e-3 leaves ~10x headroom and still catches that.
# gemma-3-270m: llama.cpp's GELU (ggml-cpu vec.h, GGML_GELU_FP16) looks the value up in an f16
# table, rounding its input and output to f16 even in an F32 model: measured 2.7e-2 (logits up to
# 66), 1.3e-2 with flashllm's GeGLU rounded the same way (an experiment, not kept); 5e-2 still
# catches a wrong RoPE base, window or norm (whole units) but not an f16 KV cache there.
F32_LOGIT_TOL = {"smollm2-135m": 5e-3, "qwen2.5-coder-0.5b": 5e-3, "gemma-3-270m": 5e-2}

pytestmark = pytest.mark.realmodel


def fixture(name: str):
    meta = json.loads((FIXTURES / f"{name}.json").read_text())
    arrays = np.load(FIXTURES / f"{name}.npz", allow_pickle=False)
    return meta, arrays


@pytest.fixture(scope="module")
def flashllm_greedy(real_model):
    """run(name, prompt_ids, n) -> flashllm's n greedy tokens after prompt_ids, generated once
    per (name, prompt_ids, n): the quantized and f32 fixtures share their prompts."""
    done = {}

    def run(name: str, prompt_ids: np.ndarray, n: int) -> list:
        key = (name, tuple(prompt_ids.tolist()), n)
        if key not in done:
            net = real_model(name)
            net.reset()
            got = []
            generate(net, Sampler(SamplerParams(temp=0.0)), list(key[1]), n, on_token=got.append)
            done[key] = got
        return done[key]

    return run


def teacher_forced(net, arrays, prompt: str) -> np.ndarray:
    net.reset()
    return net.forward(arrays[f"{prompt}.tf_ids"], 0)                  # (64, vocab)


@pytest.mark.parametrize("name", MODELS)
def test_teacher_forced_top1_and_top16_logits(real_model, name):
    check_teacher_forced(real_model(name), name)


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma-3-270m", "qwen2.5-coder-1.5b"])
def test_native_conversion_teacher_forced(real_model, name):
    """The default (native) conversion — the GGUF's own tensors, down columns re-quantized per
    layer (the 1.5B's to q4_k / q6_k) — against llama.cpp on the same GGUF, with int8
    activations on both sides: top-1 as above, log-probabilities within NATIVE_LOGPROB_TOL
    from the second position on. The first (a prediction from one token, whose massive
    activations meet the re-quantized down columns) is left out of that bound: there the 1.5B's
    top-16 log-probabilities differ by up to 5.4 with q4_k / q6_k columns, 3.0 with q5_k / q6_k,
    1.8 with q8_0, 5.2 for its --dtype q4_k conversion. SmolLM2 (its down columns re-quantized
    to q8_0) agreed on 161 of 165 clear positions before a dense run multiplied the GGUF's own
    down rows (down.bin); with them 164 of 165 (99.4%) on an AVX-512 machine. On an AVX2-only
    one llama.cpp itself agrees with the fixture at 164 of 165 and flashllm at 163 (the other:
    "chat" 50, llama.cpp's margin 0.61 there, 0.50 on that machine, flashllm's -0.12, the f32
    conversion's 0.39); hence NATIVE_NEAR_TIE: 138 of 139 there."""
    check_teacher_forced(real_model(name, "native"), name, NATIVE_LOGPROB_TOL, first=1,
                         near_tie=NATIVE_NEAR_TIE)


def check_teacher_forced(net, name: str, tol: float = LOGPROB_TOL, first: int = 0,
                         near_tie: float = NEAR_TIE) -> None:
    """Top-1 agreement >= 99% where llama.cpp's margin is clear, top-16 log-probabilities
    within tol from position `first` on, over the fixture's prompts."""
    _, arrays = fixture(name)
    agree, decided, raw_agree, total, worst = 0, 0, 0, 0, 0.0
    for prompt in PROMPTS:
        logits = teacher_forced(net, arrays, prompt)                     # (64, vocab)
        top_ids = arrays[f"{prompt}.tf_top_ids"]                         # (64, 16)
        top_logits = arrays[f"{prompt}.tf_top_logits"]                   # (64, 16)
        same = logits.argmax(axis=1) == top_ids[:, 0]                    # (64,) bool
        clear = top_logits[:, 0] - top_logits[:, 1] >= near_tie          # (64,) bool
        agree += int((same & clear).sum())
        decided += int(clear.sum())
        raw_agree += int(same.sum())
        total += len(same)
        lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)  # (64,)
        ours = np.take_along_axis(logits, top_ids, axis=1) - lse[:, None]                   # (64, 16)
        ref = top_logits - arrays[f"{prompt}.tf_logsumexp"][:, None]                         # (64, 16)
        worst = max(worst, float(np.abs(ours - ref)[first:].max()))
    print(f"{name}: top-1 agreement {agree}/{decided} where llama.cpp's margin >= {near_tie} "
          f"({raw_agree}/{total} over all positions), max |logprob diff| at top-16 = {worst:.4f}")
    assert agree / decided >= 0.99
    assert worst < tol


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_until_a_near_tie(flashllm_greedy, name, prompt):
    got, want, checked = greedy_against(flashllm_greedy, name, name, prompt, NEAR_TIE)
    assert got[:checked] == want[:checked]


def greedy_against(flashllm_greedy, name: str, fixture_name: str, prompt: str, near_tie: float):
    """flashllm's greedy tokens next to the fixture's: (got, want, steps before llama.cpp's first
    top-2 margin below near_tie); prints where they part and llama.cpp's margin there."""
    _, arrays = fixture(fixture_name)
    want = arrays[f"{prompt}.greedy_ids"].tolist()                      # (64,)
    margin = arrays[f"{prompt}.greedy_margin"]                           # (64,)
    got = flashllm_greedy(name, arrays[f"{prompt}.prompt_ids"], len(want))
    ties = np.flatnonzero(margin < near_tie)
    checked = int(ties[0]) if len(ties) else len(want)
    parted = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if parted is not None:
        print(f"{fixture_name} {prompt}: parts from llama.cpp at step {parted}, where its top-2 "
              f"margin is {margin[parted]:.2e} (first near tie at step {checked})")
    else:
        print(f"{fixture_name} {prompt}: all {len(want)} greedy tokens identical (smallest "
              f"llama.cpp margin {margin.min():.2e})")
    return got, want, checked


@pytest.mark.parametrize("name", MODELS)
def test_f32_teacher_forced_all_positions(real_model, name):
    """llama.cpp at f32 vs flashllm at f32, same weights: top-1 over all 192 positions and the
    raw top-16 logits."""
    meta, arrays = fixture(f"{name}-f32")
    source = gguf_path(name)
    with open(source, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    assert meta["source"]["model_sha256"] == digest, f"the f32 fixture was not made from {source}"
    assert meta["settings"]["type_k"] == meta["settings"]["type_v"] == "f32"
    net = real_model(name)
    agree, total, worst, min_margin, where = 0, 0, 0.0, np.inf, ""
    for prompt in PROMPTS:
        logits = teacher_forced(net, arrays, prompt)                     # (64, vocab)
        top_ids = arrays[f"{prompt}.tf_top_ids"]                         # (64, 16)
        top_logits = arrays[f"{prompt}.tf_top_logits"]                   # (64, 16)
        same = logits.argmax(axis=1) == top_ids[:, 0]                    # (64,) bool
        agree += int(same.sum())
        total += len(same)
        diff = np.abs(np.take_along_axis(logits, top_ids, axis=1) - top_logits)  # (64, 16)
        if diff.max() > worst:
            worst, where = float(diff.max()), f"{prompt} position {int(diff.max(1).argmax())}"
        for i in np.flatnonzero(~same):
            print(f"{name}-f32 {prompt}: top-1 differs at position {i}, llama.cpp top-2 margin "
                  f"{top_logits[i, 0] - top_logits[i, 1]:.2e}")
        min_margin = min(min_margin, float((top_logits[:, 0] - top_logits[:, 1]).min()))
    print(f"{name}-f32: top-1 agreement {agree}/{total} over all positions (smallest llama.cpp "
          f"top-2 margin {min_margin:.2e}), max |logit diff| at top-16 = {worst:.2e} ({where})")
    assert agree / total >= 0.99
    assert worst < F32_LOGIT_TOL[name]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("name", MODELS)
def test_f32_greedy_matches_until_a_near_tie(flashllm_greedy, name, prompt):
    got, want, checked = greedy_against(flashllm_greedy, name, f"{name}-f32", prompt,
                                        2 * F32_LOGIT_TOL[name])
    assert got[:checked] == want[:checked]
