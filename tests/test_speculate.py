"""Speculative decoding with prompt-lookup drafts: the lookup, the draft length, the exactness
of the verification (a sampler statistic and greedy generation against plain decoding on the
scripted model, the real SmolLM2 and through the CLI and the chat)."""
from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from flashllm.generation.chat import ChatSession
from flashllm.generation.chat_template import ChatTemplate
from flashllm.cli import app
from flashllm.generation.generate import generate
from flashllm.runtime.model import Model
from flashllm.generation.sampler import Sampler, SamplerParams
from flashllm.generation.speculate import (DraftError, DraftLength, Guesses, NgramDraft, verify,
                                           verify_tree)
from test_chat import tiny  # noqa: F401  (the tiny converted model fixture)
from test_generate import ScriptedModel, greedy

LOOP = [1, 7, 8, 9, 10, 11, 12, 13, 14, 15]      # a context that repeats: every guess holds


class LoopModel(ScriptedModel):
    """Peaked on LOOP[(pos + 1) % len(LOOP)] whatever it is fed."""

    def forward(self, tokens, pos0, last_only=False, siblings=(), progress=None):  # drafts: none
        tokens = np.asarray(tokens)                                     # (T,)
        self.calls.append((tokens.tolist(), pos0))
        logits = np.zeros((len(tokens), 50), dtype=np.float32)          # (T, vocab)
        for row, p in enumerate(range(pos0, pos0 + len(tokens))):
            logits[row, LOOP[(p + 1) % len(LOOP)]] = 10.0
        return logits[-1:] if last_only else logits


def eager(n: int) -> NgramDraft:
    """A draft that always checks n guesses (cheap guesses, high acceptance learned)."""
    d = NgramDraft(n)
    d.length.c1, d.length.ce, d.length.kept, d.length.reached = 1.0, 0.0, 9.0, 10.0
    return d


def test_lookup_takes_the_longest_then_latest_match():
    d = NgramDraft(8)
    h = [5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2]
    assert d.lookup(h, 3) == [4, 7, 1]          # "1 2" last seen before 4 (not before 3)
    h2 = [5, 1, 2, 3, 9, 1, 2, 4, 7, 5, 1, 2]   # not an extension of h: the index is rebuilt
    assert d.lookup(h2, 8) == [3, 9, 1, 2, 4, 7, 5, 1]     # "5 1 2" beats the later "1 2"
    assert d.lookup(h2, 0) == []
    assert d.lookup([4, 4, 6], 2) == []


def test_the_index_grows_with_the_history():
    d, h = NgramDraft(4), [3, 1, 4, 1, 5]
    assert d.lookup(h, 4) == []             # "1 5" and "5" were not seen before
    h += [9, 2, 6, 5]
    assert d.lookup(h, 4) == [9, 2, 6, 5]   # no "6 5" before: the last "5"
    h += [3, 1]
    assert d.lookup(h, 4) == [4, 1, 5, 9]
    assert d.lookup([3, 1, 4, 1], 2) == [4, 1]   # a shorter history: rebuilt, "1" before 4


def test_lookup_after_a_tail_of_guesses():
    """The n-gram ending history + tail (guesses not yet verified) is looked up in history's
    index; the tail itself is not indexed, so the next history finds the index unchanged."""
    d = NgramDraft(8)
    h = [5, 1, 2, 3, 9, 1, 2, 4, 7, 0]
    assert d.lookup(h, 3, [1, 2]) == [4, 7, 0]        # "0 1 2" unseen: "1 2" last before 4
    assert d.lookup(h, 2, [9]) == [1, 2]              # "0 9" unseen: "9" before 1
    assert d.lookup(h, 2, [8]) == []
    assert d.lookup(h + [3], 2) == [9, 1]             # an extension of h: "0 3" unseen, "3"


def test_draft_length_follows_acceptance_and_cost():
    cheap = DraftLength(8)
    for _ in range(20):                       # passes that keep every guess, guesses nearly free
        cheap.observe(0, 0, 0.30)
        cheap.observe(8, 8, 0.31)
    assert cheap.choose() == 8
    dear = DraftLength(8)
    for _ in range(20):                       # guesses a quarter of a pass, one in ten kept
        dear.observe(0, 0, 0.07)
        dear.observe(4, 0 if _ % 10 else 1, 0.14)
    picks = [dear.choose() for _ in range(8)]
    assert picks == [0, 0, 0, 1, 0, 0, 0, 1]  # off, but every 4th pass probes one guess
    with pytest.raises(DraftError):
        NgramDraft(-1)


def test_sample_given_draws_the_sampler_distribution():
    """Whatever the guess, the token keeps the distribution sample() draws from."""
    s = Sampler(SamplerParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7))
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))   # (4,)
    n = 40000
    for guess in (0, 2, 3):
        counts = np.bincount([s.sample_given(logits, [], guess) for _ in range(n)], minlength=4)
        np.testing.assert_allclose(counts / n, [0.5, 0.3, 0.15, 0.05], atol=0.01)
    g = Sampler(SamplerParams(temp=0.0))
    assert g.sample_given(logits, [], 0) == 0 and g.sample_given(logits, [], 2) == 0


def test_verify_keeps_guesses_up_to_the_first_miss():
    rows = np.zeros((4, 50), np.float32)                                # (1 + 3, vocab)
    rows[[0, 1, 2, 3], [7, 8, 30, 31]] = 10.0
    assert verify(greedy(), rows, [7, 8, 9], [1]) == [7, 8, 30]
    assert verify(greedy(), rows[:3], [7, 8], [1]) == [7, 8, 30]        # all kept: one more


def test_verify_tree_takes_a_sibling_where_its_guess_fails():
    rows = np.zeros((6, 50), np.float32)            # (1 + 3 guesses + 2 siblings, vocab)
    rows[[0, 1, 2, 3, 4, 5], [7, 40, 30, 31, 44, 45]] = 10.0
    # guess 1 (8) fails where the model wants 40: its sibling 40 is taken, its row (5) yields 45
    assert verify_tree(greedy(), rows, [7, 8, 9], {0: 3, 1: 40}, [1]) == ([7, 40, 45], 1)
    # a sibling that is not the model's token changes nothing
    assert verify_tree(greedy(), rows, [7, 8, 9], {1: 41}, [1]) == ([7, 40], None)
    # a sibling of a guess that is kept is never looked at
    assert verify_tree(greedy(), rows, [7, 40, 9], {0: 3}, [1]) == ([7, 40, 30], None)


def test_verify_tree_keeps_the_distribution():
    """Sampled: the first token is distributed as sample() draws it, whatever the guess and its
    sibling; a sibling is taken exactly when that token is the sibling."""
    s = Sampler(SamplerParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3))
    rows = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 3, dtype=np.float32))  # (1 + 1 + 1, 4)
    n = 30000
    for guess, sib in ((0, 1), (2, 0), (3, 2)):
        outs = [verify_tree(s, rows, [guess], {0: sib}, []) for _ in range(n)]
        counts = np.bincount([o[0][0] for o in outs], minlength=4)
        np.testing.assert_allclose(counts / n, [0.5, 0.3, 0.15, 0.05], atol=0.01)
        assert all((kept is not None) == (toks[0] == sib) for toks, kept in outs)


@pytest.mark.parametrize("n_predict, stops", [(25, ()), (7, ()), (40, (12,))])
def test_generation_with_drafts_equals_plain_decoding(n_predict, stops):
    plain, fast = [], []
    a, b = LoopModel(n_ctx=64), LoopModel(n_ctx=64)
    sa = generate(a, greedy(), LOOP[:4], n_predict, stop_ids=stops, on_token=plain.append)
    sb = generate(b, greedy(), LOOP[:4], n_predict, stop_ids=stops, on_token=fast.append,
                  draft=eager(6))
    assert fast == plain and sb.n_gen == sa.n_gen and sb.stopped == sa.stopped
    assert sb.n_decode + sb.n_accepted == sa.n_decode or sb.stopped
    feeds = [(toks[0], p) for toks, p in b.calls[1:]]  # each pass feeds the right token next
    assert all(t == LOOP[p % len(LOOP)] for t, p in feeds)
    assert [p for _, p in feeds] == sorted(set(p for _, p in feeds))
    if n_predict == 25:
        assert sb.n_accepted > 10 and sb.n_decode < sa.n_decode / 2


def test_the_context_end_bounds_the_guesses():
    m = LoopModel(n_ctx=20)
    out = []
    stats = generate(m, greedy(), LOOP[:4], -1, on_token=out.append, draft=eager(8))
    assert out == [LOOP[(4 + i) % len(LOOP)] for i in range(17)]
    assert max(p + len(t) for t, p in m.calls) <= 20 and stats.n_gen == 17


def test_real_model_greedy_tokens_are_unchanged(real_model):
    """SmolLM2-135M (f32): a repetitive prompt, with and without drafts, 24 greedy tokens."""
    net = real_model("smollm2-135m", "f32")
    prompt = [504, 3458, 28, 504, 3458, 28, 504, 3458, 28, 504, 3458, 28, 504]
    plain, fast = [], []
    net.reset()
    generate(net, greedy(), prompt, 24, on_token=plain.append)
    net.reset()
    stats = generate(net, greedy(), prompt, 24, on_token=fast.append, draft=eager(6))
    assert fast == plain and stats.n_accepted > 0


def test_cli_draft_gives_the_same_greedy_text(tiny):  # noqa: F811
    model = str(tiny[0].path)
    args = ["run", model, "-p", "hello there hello there hello", "-n", "12", "--temp", "0"]
    plain = CliRunner().invoke(app, args + ["--no-timings"])
    fast = CliRunner().invoke(app, args + ["--draft", "4"])
    assert plain.exit_code == 0 and fast.exit_code == 0, fast.output
    assert fast.stdout == plain.stdout
    bad = CliRunner().invoke(app, args + ["--draft", "-2"])
    assert bad.exit_code == 2 and "Invalid value for '--draft'" in bad.output


def test_chat_answers_are_the_same_with_drafts(tiny):  # noqa: F811
    flash, tok = tiny
    answers = []
    for draft in (None, eager(4)):
        session = ChatSession(Model(flash, n_threads=1, n_ctx=128), tok,
                              Sampler(SamplerParams(temp=0.0)), ChatTemplate(flash.chat_template),
                              n_predict=9, draft=draft)
        text = []
        turns = [session.ask(msg, text.append) for msg in ("hello there", "hello there hello")]
        answers.append("".join(text))
        drafted = sum(t.n_drafted for t in turns)
        assert (drafted > 0) == (draft is not None)     # the template's tokens repeat: guesses
        assert sum(t.n_accepted for t in turns) <= drafted
    assert answers[0] == answers[1]


def test_guesses_cut_to_a_pass_share_keep_the_chain_first():
    """A server's share of a pass's rows (serve/worker.py): the first guesses, then the
    siblings of the guesses kept, first guess first; no more rows than the share."""
    g = Guesses([7, 8, 9], {0: 4, 2: 5})
    assert g.rows == 5
    assert (g.cut(5), g.cut(5).siblings) == ([7, 8, 9], {0: 4, 2: 5})
    assert (g.cut(4), g.cut(4).siblings) == ([7, 8, 9], {0: 4})
    assert (g.cut(2), g.cut(2).siblings) == ([7, 8], {})
    assert (g.cut(0), g.cut(0).siblings) == ([], {})
    assert all(g.cut(n).rows <= n for n in range(6))
