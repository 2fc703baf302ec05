"""The sampler against a direct, loop-by-loop transcription of llama.cpp's sampler chain
(llama-sampling.cpp: penalties, top_k, top_p, min_p, temp, dist) on fixed logits."""
from __future__ import annotations

import math

import numpy as np
import pytest

from flashllm.generation.sampler import Sampler, SamplerError, SamplerParams, top_k


def reference_chain(logits, history, temp, k, p, mp, penalty, last_n):
    """{token: probability} after llama.cpp's chain, written as plain Python loops."""
    logits = [float(v) for v in logits]
    recent = list(history) if last_n < 0 else list(history)[len(history) - last_n:] if last_n else []
    for tok in set(recent):                       # each distinct token penalized once
        logits[tok] = logits[tok] / penalty if logits[tok] > 0 else logits[tok] * penalty
    if temp <= 0:
        best = max(range(len(logits)), key=lambda i: (logits[i], -i))
        return {best: 1.0}
    cands = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    if k > 0:
        cands = cands[:k]
    if p < 1.0:
        m = max(logits[i] for i in cands)
        z = sum(math.exp(logits[i] - m) for i in cands)
        cum, cut = 0.0, len(cands)
        for n, i in enumerate(cands):
            cum += math.exp(logits[i] - m) / z
            if cum >= p:
                cut = n + 1
                break
        cands = cands[:cut]
    if mp > 0:
        top = max(logits[i] for i in cands)
        cands = [i for i in cands if logits[i] >= top + math.log(mp)]
    m = max(logits[i] / temp for i in cands)
    w = {i: math.exp(logits[i] / temp - m) for i in cands}
    z = sum(w.values())
    return {i: v / z for i, v in w.items()}


LOGITS = np.random.default_rng(7).normal(0, 2.0, size=300).astype(np.float32)   # (vocab,)
HISTORY = [3, 17, 17, 250, int(np.argmax(LOGITS)), 99, 5]

CASES = [
    dict(temp=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, repeat_last_n=64),
    dict(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, repeat_last_n=64),
    dict(temp=0.5, top_k=10, top_p=1.0, min_p=0.0, repeat_penalty=1.3, repeat_last_n=3),
    dict(temp=1.5, top_k=0, top_p=0.5, min_p=0.0, repeat_penalty=1.1, repeat_last_n=-1),
    dict(temp=1.0, top_k=100, top_p=0.9, min_p=0.2, repeat_penalty=1.2, repeat_last_n=64),
    dict(temp=0.7, top_k=5, top_p=0.3, min_p=0.5, repeat_penalty=1.0, repeat_last_n=0),
]


@pytest.mark.parametrize("case", CASES)
def test_distribution_matches_reference_chain(case):
    ref = reference_chain(LOGITS, HISTORY, case["temp"], case["top_k"], case["top_p"],
                          case["min_p"], case["repeat_penalty"], case["repeat_last_n"])
    ids, probs = Sampler(SamplerParams(seed=0, **case)).distribution(LOGITS, HISTORY)
    assert sorted(int(i) for i in ids) == sorted(ref)
    got = dict(zip((int(i) for i in ids), probs))
    for tok, pr in ref.items():
        assert got[tok] == pytest.approx(pr, rel=1e-5, abs=1e-9)


def test_draws_follow_the_distribution():
    case = CASES[4]
    ref = reference_chain(LOGITS, HISTORY, case["temp"], case["top_k"], case["top_p"],
                          case["min_p"], case["repeat_penalty"], case["repeat_last_n"])
    sampler = Sampler(SamplerParams(seed=123, **case))
    n = 20000
    draws = np.array([sampler.sample(LOGITS, HISTORY) for _ in range(n)])   # (n,)
    assert set(draws.tolist()) <= set(ref)
    for tok, pr in ref.items():   # 5 standard deviations of a binomial frequency
        assert abs((draws == tok).mean() - pr) < 5 * math.sqrt(pr * (1 - pr) / n) + 1e-3


def test_same_seed_same_tokens_other_seed_differs():
    params = dict(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a = [Sampler(SamplerParams(seed=42, **params)).sample(LOGITS) for _ in range(1)]
    s1, s2, s3 = (Sampler(SamplerParams(seed=s, **params)) for s in (42, 42, 43))
    seq1 = [s1.sample(LOGITS) for _ in range(50)]
    seq2 = [s2.sample(LOGITS) for _ in range(50)]
    seq3 = [s3.sample(LOGITS) for _ in range(50)]
    assert seq1 == seq2 and seq1[0] == a[0]
    assert seq1 != seq3


def test_greedy_is_penalized_argmax():
    best = int(np.argmax(LOGITS))
    assert Sampler(SamplerParams(temp=0.0)).sample(LOGITS, []) == best
    penalized = Sampler(SamplerParams(temp=0.0, repeat_penalty=100.0)).sample(LOGITS, [best])
    expect = reference_chain(LOGITS, [best], 0.0, 0, 1.0, 0.0, 100.0, 64)
    assert penalized != best and {penalized: 1.0} == expect


@pytest.mark.parametrize("bad", [dict(top_p=0.0), dict(top_p=1.5), dict(min_p=-0.1),
                                 dict(repeat_penalty=0.0), dict(repeat_last_n=-2)])
def test_bad_params_are_named(bad):
    with pytest.raises(SamplerError, match=next(iter(bad))):
        Sampler(SamplerParams(**bad))


def test_top_k_is_the_stable_full_sorts_first_k():
    """The partition path keeps exactly what a stable descending sort keeps, ties included."""
    rng = np.random.default_rng(11)
    for trial in range(200):
        n = int(rng.integers(1, 300))
        logits = (rng.integers(-3, 3, n) if trial % 2 else rng.standard_normal(n)).astype(np.float32)
        k = int(rng.integers(1, n + 2))
        order = np.argsort(-logits, kind="stable")                  # (n,)
        order = order[:k] if k < n else order
        ids, vals = top_k(np.arange(n) + 1000, logits, k)
        np.testing.assert_array_equal(ids, order + 1000)
        np.testing.assert_array_equal(vals, logits[order])


@pytest.mark.parametrize("case", CASES)
def test_banned_tokens_are_llama_cpps_minus_infinity_bias(case):
    """--ignore-eos: llama.cpp adds a logit bias of -inf to the end-of-generation tokens before
    the chain; the distribution is the reference chain's on those logits, and no draw is one of
    them (the greedy argmax among them included)."""
    banned = (int(np.argmax(LOGITS)), 17, 3)
    biased = LOGITS.copy()
    biased[list(banned)] = -np.inf
    ref = reference_chain(biased, HISTORY, case["temp"], case["top_k"], case["top_p"],
                          case["min_p"], case["repeat_penalty"], case["repeat_last_n"])
    sampler = Sampler(SamplerParams(seed=5, banned=banned, **case))
    ids, probs = sampler.distribution(LOGITS, HISTORY)
    assert sorted(int(i) for i in ids) == sorted(ref)
    got = dict(zip((int(i) for i in ids), probs))
    for tok, pr in ref.items():
        assert got[tok] == pytest.approx(pr, rel=1e-5, abs=1e-9)
    assert not set(banned) & {sampler.sample(LOGITS, HISTORY) for _ in range(300)}
    assert sampler.mode(LOGITS, HISTORY) not in banned
