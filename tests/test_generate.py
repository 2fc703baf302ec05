"""The generation loop on a scripted model: whatever token it is fed, the next-token logits put
all the mass on script[pos + 1]. The expected output is the script itself."""
from __future__ import annotations

import re

import numpy as np
import pytest

from flashllm.generation.generate import GenStats, decode_pass, generate, prefill
from flashllm.generation.sampler import Sampler, SamplerParams

VOCAB = 50
SCRIPT = [1, 7, 8, 9, 10, 11, 12, 13, 2, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]


class ScriptedModel:
    """forward(tokens (T,), pos0) -> logits (T, vocab), peaked on SCRIPT[pos + 1]; records calls."""

    def __init__(self, n_ctx: int = 64):
        self.n_ctx = n_ctx
        self.calls = []

    def forward(self, tokens, pos0, last_only=False, siblings=(), progress=None):  # drafts: none
        tokens = np.asarray(tokens)                              # (T,)
        self.calls.append((tokens.tolist(), pos0))
        positions = range(pos0, pos0 + len(tokens))
        logits = np.zeros((len(tokens), VOCAB), dtype=np.float32)  # (T, vocab)
        for row, p in enumerate(positions):
            logits[row, SCRIPT[(p + 1) % len(SCRIPT)]] = 10.0
        return logits[-1:] if last_only else logits


def greedy():
    return Sampler(SamplerParams(temp=0.0))


def test_verbs_return_next_token_logits():
    m = ScriptedModel()
    assert int(np.argmax(prefill(m, SCRIPT[:3]))) == SCRIPT[3]
    assert decode_pass(m, greedy(), None, SCRIPT[:4], 3, 5)[:2] == ([SCRIPT[4]], 0)
    assert m.calls == [(SCRIPT[:3], 0), ([SCRIPT[3]], 3)]


def test_n_predict_limits_tokens_and_positions_follow():
    m, out = ScriptedModel(), []
    stats = generate(m, greedy(), SCRIPT[:2], 4, stop_ids=[2], on_token=out.append)
    assert out == SCRIPT[2:6]
    assert (stats.n_prompt, stats.n_gen, stats.n_decode, stats.stopped) == (2, 4, 3, False)
    assert m.calls == [(SCRIPT[:2], 0), ([SCRIPT[2]], 2), ([SCRIPT[3]], 3), ([SCRIPT[4]], 4)]


def test_stop_token_ends_without_being_emitted():
    m, out = ScriptedModel(), []
    stats = generate(m, greedy(), SCRIPT[:3], 100, stop_ids=[2, 99], on_token=out.append)
    assert out == SCRIPT[3:8]
    assert stats.stopped and stats.n_gen == 5


def test_negative_n_predict_runs_until_the_context_is_full():
    m, out = ScriptedModel(n_ctx=12), []
    stats = generate(m, greedy(), SCRIPT[9:12], -1, on_token=out.append)
    assert len(out) == 12 - 3 + 1 and stats.n_decode == 12 - 3
    assert max(pos for _, pos in m.calls) == 11


def test_zero_n_predict_only_prefills():
    m = ScriptedModel()
    stats = generate(m, greedy(), SCRIPT[:4], 0)
    assert (stats.n_gen, stats.n_decode, len(m.calls)) == (0, 0, 1)


def test_summary_is_a_llama_cpp_timings_line():
    s = GenStats(n_prompt=8, n_gen=5, n_decode=4, prefill_s=0.5, decode_s=0.2)
    text = s.summary()
    m = re.search(r"prompt eval time =\s+500\.00 ms /\s+8 tokens \(\s+62\.50 ms per token,"
                  r"\s+16\.00 tokens per second\)", text)
    assert m, text
    assert re.search(r"eval time =\s+200\.00 ms /\s+4 runs\s+\(\s+50\.00 ms per token,"
                     r"\s+20\.00 tokens per second\)", text), text
    assert s.prefill_tps == pytest.approx(16.0) and s.decode_tps == pytest.approx(20.0)


def test_eval_line_counts_tokens_made_and_the_draft_line_the_passes():
    """Issue 47: 20 passes that kept 43 guesses made 63 tokens; llama.cpp's eval line counts
    tokens, so it says 63 (and the speed --json reports), the draft line says 20 passes."""
    s = GenStats(n_prompt=8, n_gen=63, n_decode=20, n_drafted=60, n_accepted=43,
                 prefill_s=0.5, decode_s=5.35402)
    text = s.summary()
    assert re.search(r"\n\s+eval time =\s+5354\.02 ms /\s+63 runs\s+\(\s+84\.98 ms per token,"
                     r"\s+11\.77 tokens per second\)", text), text
    assert "20 passes, 3.15 tokens a pass" in text, text
    assert s.decode_tps == pytest.approx(63 / 5.35402)


def test_ignore_eos_runs_past_the_stop_token_to_n_predict():
    """A sampler that bans the stop token (--ignore-eos) never draws it: the run makes its
    n_predict tokens, the script's next-best token (all logits but the peak are 0: the lowest
    id, as numpy's argmax picks) where the stop token was."""
    m, out = ScriptedModel(), []
    ban = Sampler(SamplerParams(temp=0.0, banned=(2,)))
    stats = generate(m, ban, SCRIPT[:3], 10, stop_ids=[2], on_token=out.append)
    row = np.zeros(VOCAB, np.float32)              # the scripted row at the stop, 2 banned
    row[2] = -np.inf
    assert out == SCRIPT[3:8] + [int(np.argmax(row))] + SCRIPT[9:13]
    assert 2 not in out and not stats.stopped and stats.n_gen == 10
