"""Self-speculative decoding (--draft-kind self): the resident sub-network against a dense model
whose uncached neurons are removed from the weights; a draft leaves no trace in the KV cache;
greedy output equals plain decoding (tiny model, and SmolLM2 through the CLI with the FFN and the
output head streamed); sampled tokens keep plain decoding's distribution."""
from __future__ import annotations

import re

import numpy as np
import pytest
from typer.testing import CliRunner

from flashllm.cli import app
from flashllm.ffi.reader import Reader
from flashllm.format.manifest import read_manifest
from flashllm.format.reader import open_flash
from flashllm.generation.generate import generate
from flashllm.generation.sampler import Sampler, SamplerParams
from flashllm.generation import self_draft
from flashllm.generation.self_draft import PASS_TOKENS, SIBLING_EXPLORE, SelfDraft
from flashllm.generation.speculate import DraftLength
from flashllm.runtime import budget
from flashllm.runtime.budget import parse_budget
from flashllm.runtime.model import Model
from flashllm.runtime.resident import ResidentError, resident_model
from flashllm.runtime.weights import DenseWeights
from flashllm.sparsity.predictor import AllSlots
from test_generate import greedy
from test_sparse_ffn import flash_ffn, write_model
from tiny_sources import write_arrays

MiB = 1 << 20
CACHED = 40          # of the tiny model's 96 neurons per layer
TEMP = 4.0           # the tiny random model's logits are far apart: a temperature spreads them


def _plans_draft(stderr: str) -> bool:
    """Whether a --stats plan summary counts a self draft's DRAM ("..., draft 21 MiB, ...")."""
    return re.search(r", draft \d", stderr) is not None


def streamed(path, head: bool = True, n_ctx: int = 32):
    """A Model over path: the FFN through a SparseFlashFfn whose caches pin slots 0 .. CACHED-1,
    the output head streamed from dense.bin when head."""
    flash, ffn = flash_ffn(path, AllSlots(open_flash(path).config.n_ff), "64MiB",
                           staging_rows=16, capacity=CACHED, n_pinned=CACHED)
    w = DenseWeights(flash, 1, {"output.weight"} if head else (),
                     Reader(flash.dense_file, n_threads=1), chunk_bytes=1)
    return Model(flash, n_threads=1, n_ctx=n_ctx, ffn=ffn, weights=w)


def eager(model, sampler, n: int) -> SelfDraft:
    """A self draft that checks n guesses every pass (a plain pass is known, guesses kept)."""
    d = SelfDraft(model, sampler, n)
    d.length.c1, d.length.ce, d.length.kept, d.length.reached = 1.0, 0.0, 9.0, 10.0
    d.length.refresh = 0
    return d


def test_resident_model_is_the_model_without_its_uncached_neurons(tmp_path):
    """Reference: the dense model of the same weights with every neuron outside the caches
    zeroed (layer 0 stored in a random order: its cache holds order[:CACHED])."""
    cfg, arrays, order = write_model(tmp_path / "m", True, "f32")
    cut = {k: v.copy() for k, v in arrays.items()}
    for layer in range(cfg.n_layers):
        cached = order[:CACHED] if layer == 0 else np.arange(CACHED)        # neuron ids
        gone = np.setdiff1d(np.arange(cfg.n_ff), cached)
        cut[f"blk.{layer}.ffn_up.weight"][gone] = 0.0
        cut[f"blk.{layer}.ffn_down.weight"][:, gone] = 0.0
    write_arrays(tmp_path / "ref", cfg, cut, "f32")
    ref = Model(open_flash(tmp_path / "ref"), n_threads=1, n_ctx=32)
    tokens = np.array([1, 5, 9, 30, 2])
    want = ref.forward(tokens, 0)                                              # (5, vocab)
    draft = resident_model(streamed(tmp_path / "m", head=False))               # resident head
    np.testing.assert_allclose(draft.forward(tokens, 0), want, rtol=1e-4, atol=1e-4)
    draft = resident_model(streamed(tmp_path / "m"), head_rows=8)              # held rows
    draft.w.see([30, 2])
    got = draft.forward(tokens, 0)                                             # (5, vocab)
    held = np.r_[np.arange(8), [30, 2]]
    np.testing.assert_allclose(got[:, held], want[:, held], rtol=1e-4, atol=1e-4)
    assert np.isneginf(np.delete(got, held, axis=1)).all()


def test_a_resident_model_needs_caches_and_resident_attention(tmp_path):
    write_model(tmp_path / "m", True, "f32")
    with pytest.raises(ResidentError, match="streams from flash"):
        resident_model(Model(open_flash(tmp_path / "m"), n_threads=1, n_ctx=16))
    model = streamed(tmp_path / "m")
    model.w = DenseWeights(model.w.flash, 1, {"blk.1.attn_q.weight"},
                           Reader(model.w.flash.dense_file, n_threads=1))
    with pytest.raises(ResidentError, match="streams 1 layers'"):
        resident_model(model)


def test_a_sibling_is_the_chain_with_it_in_its_guess_place(tmp_path):
    """A pass with siblings (Model.forward): each sibling's logits are those of a pass of as
    many tokens with the sibling in the chain in its guess's place, the chain's rows are
    unchanged (bit for bit), and keep_sibling leaves the cache as that pass would. (This f32
    model's kernels round a token by where it sits in a tile of tokens, so a sibling, last in
    its pass, matches to rounding; the packed k-quant products do not: test_budget_rss.py.)"""
    write_model(tmp_path / "m", True, "f32")
    model, ref = streamed(tmp_path / "m"), streamed(tmp_path / "m")
    for m in (model, ref):
        m.forward(np.array([1, 5, 9, 30]), 0)
    chain, sibs = [2, 17, 8, 11], {1: 25, 2: 6}          # sibling of chain token j: {j: token}
    rows = model.forward(np.array(chain + list(sibs.values())), 4, siblings=list(sibs))
    k, v = ref.k_cache.copy(), ref.v_cache.copy()
    plain = ref.forward(np.array(chain + [3, 3]), 4)                              # (6, vocab)
    np.testing.assert_array_equal(rows[:4], plain[:4])
    for s, (j, token) in enumerate(sibs.items()):
        ref.k_cache[:], ref.v_cache[:] = k, v
        alt = chain[:j] + [token]
        want = ref.forward(np.array(alt + [3] * (6 - len(alt))), 4)               # (6, vocab)
        np.testing.assert_allclose(rows[4 + s], want[j], rtol=1e-5, atol=1e-5)
    model.keep_sibling(1, 4 + 2)                       # sibling 1 (token 6) at position 6
    np.testing.assert_allclose(model.k_cache[:, :7], ref.k_cache[:, :7], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(model.v_cache[:, :7], ref.v_cache[:, :7], rtol=1e-5, atol=1e-5)
    assert not np.array_equal(model.k_cache[:, 6], k[:, 6])          # not the chain's token
    assert model.fed[6] == 6


def test_siblings_stop_while_few_are_taken(tmp_path):
    """A draft proposes siblings while enough of them are taken; when few are, only one pass
    in SIBLING_EXPLORE checks them (so a text where they start to pay is noticed)."""
    write_model(tmp_path / "m", True, "f32")
    resident = resident_model(streamed(tmp_path / "m", head=False, n_ctx=64))
    d = eager(resident, Sampler(SamplerParams(temp=TEMP, seed=1)), 2)
    d.hints = None
    history = [1, 5, 9, 30]
    with_sib = [bool(d.propose(history, 2, 3).siblings) for _ in range(4)]
    assert all(with_sib)                               # TEMP spreads the draft's probabilities
    for _ in range(40):
        d.observe(2, 0, 1.0, (2, 0))                   # none taken
    with_sib = [bool(d.propose(history, 2, 3).siblings) for _ in range(2 * SIBLING_EXPLORE)]
    assert sum(with_sib) == 2
    for _ in range(40):
        d.observe(2, 1, 1.0, (2, 1))                   # half taken
    assert d.propose(history, 2, 3).siblings


@pytest.mark.parametrize("second_per_token, on", [(0.001, True), (0.05, False)])
def test_siblings_pay_by_what_a_token_costs_the_pass(tmp_path, second_per_token, on):
    """The share of siblings taken they need is measured: a token's place in a pass (seconds
    without the drafting, against the tokens checked) over what a token made costs. With one
    in 16 taken, siblings stay on where a checked token is nearly free (a pass of reads) and go
    (but for one pass in SIBLING_EXPLORE) where it costs half a pass (all weights in DRAM)."""
    write_model(tmp_path / "m", True, "f32")
    resident = resident_model(streamed(tmp_path / "m", head=False, n_ctx=64))
    d = eager(resident, Sampler(SamplerParams(temp=TEMP, seed=1)), 2)
    d.hints = None
    history = [1, 5, 9, 30]
    assert d.sibling_floor() == self_draft.SIBLING_RATE_MIN           # nothing measured yet
    for i in range(64):
        guesses, sib = i % 3, (i % 2) * 2                             # tokens checked vary
        pass_s = 0.1 + second_per_token * (1 + guesses + sib)
        d.observe(guesses, guesses // 2, pass_s + 0.02 * guesses, (sib, int(i % 16 == 1)),
                  0.02 * guesses)
    made = 1 + np.mean([g // 2 for g in range(3)])
    spent = 0.1 + second_per_token * 3.0 + 0.02                       # the passes' means
    assert d.sibling_floor() == pytest.approx(second_per_token * made / spent, rel=0.2)
    with_sib = [bool(d.propose(history, 2, 3).siblings) for _ in range(2 * SIBLING_EXPLORE)]
    assert sum(with_sib) == (2 * SIBLING_EXPLORE if on else 2)


@pytest.mark.parametrize("n", [3, 6, 8])
def test_a_pass_stays_within_the_kernels_tiles(tmp_path, monkeypatch, n):
    """Any guess may bring a sibling, but a pass (the fed token, the guesses, their siblings)
    never holds more than PASS_TOKENS tokens: beyond, the kernels take GEMM panels, which round
    otherwise than one-token decoding, and greedy text could differ from plain decoding's."""
    monkeypatch.setattr(self_draft, "SIBLING_P_MIN", 0.0)        # every runner-up qualifies
    write_model(tmp_path / "m", True, "f32")
    resident = resident_model(streamed(tmp_path / "m", head=False, n_ctx=64))
    d = eager(resident, Sampler(SamplerParams(temp=TEMP, seed=1)), n)
    d.hints = None
    guesses = d.propose([1, 5, 9, 30], n, 3)
    assert len(guesses) == n
    assert len(guesses.siblings) == min(n, PASS_TOKENS - 1 - n)
    assert 1 + len(guesses) + len(guesses.siblings) <= PASS_TOKENS


class Hints:
    """An n-gram source that foresees given tokens (a wrong one among them where asked)."""

    def __init__(self, tokens):
        self.tokens = list(tokens)

    def lookup(self, history, k, tail=()):
        return self.tokens[len(tail):len(tail) + k]


def test_hinted_guesses_are_the_token_by_token_drafts(tmp_path):
    """Where the context's n-grams foresee the draft's guesses, one resident pass computes them:
    the same guesses as a token-by-token draft, in one pass when the hint is right, and the
    same guesses again when it is wrong from some token on (the rows after it are dropped)."""
    write_model(tmp_path / "m", True, "f32")
    resident = resident_model(streamed(tmp_path / "m", head=False, n_ctx=64))
    calls = []
    forward = resident.forward
    resident.forward = lambda ids, pos: calls.append(len(ids)) or forward(ids, pos)
    for end in (4, 9, 17):
        history = [(3 * i + 1) % 40 for i in range(end)]
        plain = eager(resident, greedy(), 5)
        plain.hints = None
        calls.clear()
        want = plain.propose(history, 5, end - 1)
        assert len(want) == 5 and calls == [1] * 5
        for wrong in (None, 0, 2):
            hinted = eager(resident, greedy(), 5)
            hint = list(want)
            if wrong is not None:
                hint[wrong] = (hint[wrong] + 1) % 40
            hinted.hints = Hints(hint)
            calls.clear()
            assert hinted.propose(history, 5, end - 1) == want
            # one pass over [last] + 4 hinted tokens; a wrong one costs a second (the hint after it)
            assert calls[0] == 5 and len(calls) == (1 if wrong is None else 2)


class Replay:
    """A draft proposing recorded guesses (and writing nothing anywhere)."""

    def __init__(self, guesses):
        self.guesses = list(guesses)

    def propose(self, history, room, pos=0):
        return self.guesses.pop(0)

    def observe(self, *args):
        pass


def test_greedy_tokens_are_plain_and_a_draft_leaves_no_trace(tmp_path):
    """Drafts that are often wrong (the resident model is a 40% FFN): the tokens are the plain
    run's, and the KV cache is bit for bit that of a run feeding the same passes (the same
    guesses, replayed) with no draft model writing its keys and values first."""
    write_model(tmp_path / "m", True, "f32")
    plain, fast, same = (streamed(tmp_path / "m") for _ in range(3))
    a, b, c = [], [], []
    generate(plain, greedy(), [1, 5, 9], 24, on_token=a.append)
    draft, seen = eager(resident_model(fast, head_rows=8), greedy(), 3), []
    propose = draft.propose
    draft.propose = lambda *args: seen.append(propose(*args)) or seen[-1]
    stats = generate(fast, greedy(), [1, 5, 9], 24, on_token=b.append, draft=draft)
    assert a == b
    assert stats.n_drafted > 0 and 0 < stats.n_accepted < stats.n_drafted  # kept and rejected
    assert stats.n_sibling_kept > 0                    # a guess's runner-up made a token
    assert stats.draft_s > 0 and stats.n_decode + stats.n_accepted == 23
    generate(same, greedy(), [1, 5, 9], 24, on_token=c.append, draft=Replay(seen))
    assert c == b
    end = 3 + 23                     # positions written: the prompt and the fed tokens
    np.testing.assert_array_equal(fast.k_cache[:, :end], same.k_cache[:, :end])
    np.testing.assert_array_equal(fast.v_cache[:, :end], same.v_cache[:, :end])


def test_sampled_tokens_keep_the_distribution(tmp_path):
    """The second token of a sampled run comes from a verified guess: over 3000 seeds its
    frequencies match the plain model's probabilities there (whatever the draft guessed)."""
    write_model(tmp_path / "m", True, "f32")
    model = streamed(tmp_path / "m", n_ctx=8)
    params = dict(temp=TEMP, top_k=0, top_p=1.0, min_p=0.0)
    resident = resident_model(model, head_rows=40)
    prompt, pairs = [1, 5, 9], []
    for seed in range(3000):
        out: list[int] = []
        stats = generate(model, Sampler(SamplerParams(seed=seed, **params)), prompt, 3,
                         on_token=out.append, draft=eager(resident, greedy(), 1))
        assert stats.n_drafted == 1                     # token 2 comes from verifying a guess
        pairs.append(out[:2])
    first = np.bincount([a for a, _ in pairs]).argmax()  # the likeliest first token
    counts = np.bincount([b for a, b in pairs if a == first], minlength=model.config.vocab_size)
    ref = Model(open_flash(tmp_path / "m"), n_threads=1, n_ctx=8)
    ref.forward(np.array(prompt), 0)
    ids, probs = Sampler(SamplerParams(**params)).distribution(ref.forward(np.array([first]), 3)[0])
    p = np.zeros(model.config.vocab_size)                            # (vocab,)
    p[ids] = probs
    assert p.max() < 0.8                                             # not one token only
    freq = counts / counts.sum()                                     # (vocab,)
    assert counts.sum() > 300
    assert np.abs(freq - p).sum() / 2 < 0.06                         # total variation


def test_draft_length_refresh_measures_a_plain_pass():
    """Passes that always check the same number of guesses cannot tell a plain pass's time from
    a guess's: one pass without guesses once the spread of the counts has faded."""
    d = DraftLength(4, refresh=3)
    assert d.choose() == 0                              # no plain pass time yet
    d.observe(0, 0, 1.0)
    picks = []
    for _ in range(100):
        k = d.choose()
        picks.append(k)
        d.observe(k, k, 1.0 + 0.01 * k)                # guesses nearly free, all kept
    plain = [i for i, k in enumerate(picks) if k == 0]
    assert 2 <= len(plain) <= 4 and plain[0] >= 3
    assert d.c1 == pytest.approx(1.0) and d.ce == pytest.approx(0.01)


def test_draft_length_fits_the_pass_time_from_the_guesses_spread():
    """Drafts that stop early check 1..k guesses: the line through (guesses, seconds) gives the
    plain pass's time and a guess's without any pass going plain after the first."""
    d = DraftLength(4, refresh=3)
    picks = []
    for i in range(60):
        k = d.choose()
        picks.append(k)
        n = min(k, 1 + i % 3)                          # the draft stopped after n guesses
        d.observe(n, n, 0.15 + 0.02 * n)
    assert picks[0] == 0 and 0 not in picks[1:]
    assert d.c1 == pytest.approx(0.15) and d.ce == pytest.approx(0.02)


def cli(*args, monkeypatch):
    monkeypatch.setattr(budget, "process_rss", lambda: 100 * MiB)
    return CliRunner().invoke(app, ["run", *args])


@pytest.mark.realmodel
def test_cli_self_draft_greedy_equals_plain_smollm2(monkeypatch):
    """SmolLM2-135M under a budget that streams the FFN's uncached neurons and the (tied) head:
    --draft 3 --draft-kind self writes the plain run's text, and says what it drafted."""
    from conftest import _converted
    path = str(_converted("smollm2-135m", "native", log=lambda m: None))
    args = [path, "-p", "The capital of France is Paris. The capital of Germany is", "-n", "24",
            "--temp", "0", "--dram-budget", "180MiB", "--draft-head-rows", "4096",
            "--no-sparse-head"]   # (both plans stream the whole head: the test of the sparse head
                                  # is test_sparse_head.py)
    plain = cli(*args, "--draft", "0", "--stats", monkeypatch=monkeypatch)
    fast = cli(*args, "--draft", "3", "--draft-kind", "self", "--stats", monkeypatch=monkeypatch)
    assert plain.exit_code == 0 and fast.exit_code == 0, fast.output
    assert fast.stdout == plain.stdout
    assert _plans_draft(fast.stderr) and "guessed" in fast.stderr and "kept" in fast.stderr
    assert not _plans_draft(plain.stderr) and "guessed" not in plain.stderr
    auto = cli(*args, "--stats", monkeypatch=monkeypatch)      # the default under this budget
    assert auto.exit_code == 0 and auto.stdout == plain.stdout, auto.output
    assert _plans_draft(auto.stderr) and "guessed" in auto.stderr


@pytest.mark.realmodel
def test_cli_drafts_by_default_only_where_the_ffn_streams(monkeypatch):
    """Without --draft a run drafts from the resident model only under a budget whose caches
    hold part of the FFN: not without a budget, not with --naive, not when every neuron is
    cached (the draft would be the model)."""
    from conftest import _converted
    path = str(_converted("smollm2-135m", "native", log=lambda m: None))
    args = [path, "-p", "The capital of France is", "-n", "12", "--temp", "0", "--stats"]
    for extra in ([], ["--dram-budget", "180MiB", "--naive"], ["--dram-budget", "2GiB"]):
        r = cli(*args, *extra, monkeypatch=monkeypatch)
        assert r.exit_code == 0, r.output
        assert "guessed" not in r.stderr and not _plans_draft(r.stderr), (extra, r.stderr)


def test_the_plan_gives_the_draft_head_rows_by_its_caches():
    """With a streamed head, the draft's rows come out of the neuron caches: the plan holds
    DRAFT_HEAD_SHARE of the caches' DRAM in rows (at least DRAFT_HEAD_MIN, at most
    DRAFT_HEAD_ROWS), so a smaller budget holds fewer, the DRAM it plans for them is what
    HeadRows holds, and rows asked for (--draft-head-rows) are kept as asked."""
    import dataclasses
    from conftest import _converted
    from conftest import plan_run
    from flashllm.runtime.plan import (AUTO_ROWS, DRAFT_HEAD_MIN, DRAFT_HEAD_ROWS,
                                       DRAFT_HEAD_SHARE, FlashOptions)
    from flashllm.runtime.resident import head_rows_bytes
    path = _converted("smollm2-135m", "native", log=lambda m: None)
    man = read_manifest(path)
    rows = []
    for mib in (140, 165):                        # the head streams at both
        opts = FlashOptions(dram_budget=parse_budget(f"{mib}MiB"))
        plain = plan_run(path, opts, 64, 64 * MiB)
        drafted = plan_run(path, dataclasses.replace(opts, draft_rows=AUTO_ROWS), 64, 64 * MiB)
        assert budget.head_name(man) in drafted.streamed
        held = head_rows_bytes(man, drafted.draft_rows, 64)
        assert held <= DRAFT_HEAD_SHARE * plain.cache_bytes < head_rows_bytes(
            man, drafted.draft_rows + 1, 64)
        assert drafted.resident["draft"] >= held
        rows.append(drafted.draft_rows)
        asked = plan_run(path, dataclasses.replace(opts, draft_rows=5000), 64, 64 * MiB)
        assert asked.draft_rows == 5000
    assert DRAFT_HEAD_MIN <= rows[0] < rows[1] <= DRAFT_HEAD_ROWS


def test_cli_refuses_a_self_draft_without_a_budget(tmp_path, monkeypatch):
    write_model(tmp_path / "m", True, "f32")
    r = cli(str(tmp_path / "m"), "-p", "a", "-n", "2", "--draft", "2", "--draft-kind", "self",
            monkeypatch=monkeypatch)
    assert r.exit_code == 1 and r.output.startswith("error: --draft-kind self drafts from")
    bad = cli(str(tmp_path / "m"), "-p", "a", "--draft-kind", "oracle", monkeypatch=monkeypatch)
    assert bad.exit_code == 2 and "'--draft-kind'" in bad.output


@pytest.mark.realmodel
def test_cli_default_keeps_plain_decoding_where_the_draft_would_stream_attention(monkeypatch):
    """A budget where the plain plan keeps every attention layer in DRAM but the draft's head rows
    would push some out (the resident model then cannot run): the default decodes plainly. (The
    rows the plan chooses itself shrink with the caches and never do: DRAFT_HEAD_ROWS are asked
    for.)"""
    import dataclasses
    from conftest import _converted
    from conftest import plan_run
    from flashllm.runtime.plan import DRAFT_HEAD_ROWS, FlashOptions
    path = _converted("smollm2-135m", "native", log=lambda m: None)
    plain_opts = FlashOptions()
    tight = None
    for mib in range(110, 260, 2):
        opts = dataclasses.replace(plain_opts, dram_budget=parse_budget(f"{mib}MiB"))
        try:
            plain = plan_run(path, opts, 64, 100 * MiB)
            drafted = plan_run(path, dataclasses.replace(opts, draft_rows=DRAFT_HEAD_ROWS), 64,
                               100 * MiB)
        except budget.BudgetError:
            continue
        blk = lambda p: any(n.startswith("blk.") for n in p.streamed)   # noqa: E731
        if not blk(plain) and blk(drafted) and 0 < plain.capacity < plain.n_ff:
            tight = mib
            break
    assert tight is not None, "no budget where the draft's rows push attention out"
    r = cli(str(path), "-p", "The capital of France is", "-n", "6", "--temp", "0",
            "--dram-budget", f"{tight}MiB", "--draft-head-rows", str(DRAFT_HEAD_ROWS), "--stats",
            monkeypatch=monkeypatch)
    assert r.exit_code == 0, r.output
    assert not _plans_draft(r.stderr) and "guessed" not in r.stderr
