"""A constrained token reads only what it may be (runtime/sparse_head.py with a grammar's mask):
few allowed rows are read and multiplied exactly, without the sketch, equal bit for bit to the
whole head's logits there; many allowed rows go through the sketch, whose candidates stay
inside the mask and hold the allowed top-k. Under a budget (the sketch in the read-ahead ring,
which skips it), greedy constrained text equals the whole head's and --stats counts less read."""
from __future__ import annotations

import json
from contextlib import contextmanager

import numpy as np
import pytest

pytest.importorskip("llguidance")

from flashllm.runtime.sparse_head import HeadNeed, SparseHead  # noqa: E402
from flashllm.runtime.weights import DenseWeights  # noqa: E402
from scripts.bench.grammar import SCHEMAS  # noqa: E402
from test_sparse_head import cli, hidden_and_logits, smollm2  # noqa: E402,F401

MiB = 1 << 20


@contextmanager
def streamed_head(flash):
    """(x (64, d), the whole head's logits (64, vocab), the dense weights, a SparseHead keeping
    the top 40 over the head streamed by its own reader), closed after."""
    from flashllm.ffi.reader import Reader
    x, full, weights = hidden_and_logits(flash, 64)
    name = "output.weight" if flash.has("output.weight") else "token_embd.weight"
    streamed = DenseWeights(flash, 2, streamed=[name],
                            reader=Reader(flash.dense_file, n_threads=4, stage_bytes=1 << 18))
    try:
        head = SparseHead(flash, streamed, HeadNeed(40), n_threads=2)
        head.exact_dims(x[1:])
        yield x, full, weights, head
    finally:
        streamed.close()


@pytest.mark.realmodel
def test_allowed_rows_are_read_alone_and_exact(smollm2):  # noqa: F811
    with streamed_head(smollm2) as (x, full, weights, head):
        vocab = full.shape[1]
        rng = np.random.default_rng(0)
        few = np.zeros(vocab, bool)
        few[rng.choice(vocab, 30, replace=False)] = True                  # (vocab,)
        out = head.logits(x[:2], [np.array([3, 5])] * 2, False, allowed=[few, few])  # (2, vocab)
        assert head.allowed_only == 2 and head.sketch_read == 0
        assert (np.isfinite(out) == few).all()                           # 3, 5: not allowed
        whole = weights.output(x[:2])                                     # (2, vocab)
        np.testing.assert_array_equal(out[:, few], whole[:, few])
        many = np.zeros(vocab, bool)                  # rows over a quarter of the sketch's bytes
        many[1000:8000] = True                                            # (vocab,)
        out = head.logits(x[2:5], [np.array([], np.int64)] * 3, False, allowed=[many] * 3)
        assert head.allowed_only == 2 and head.sketch_read > 0            # the sketch ranked them
        assert head.fallbacks == 0
        kept = np.isfinite(out)
        assert not (kept & ~many).any()
        whole = weights.output(x[2:5])                                    # (3, vocab) a pass of 3
        for t in range(3):
            top = np.flatnonzero(many)[np.argsort(-full[2 + t][many])[:40]]   # allowed top 40
            assert kept[t, top].all()
        np.testing.assert_array_equal(out[kept], whole[kept])


@pytest.mark.realmodel
def test_a_mixed_pass_ranks_only_the_rows_that_allow_many(smollm2):  # noqa: F811
    """A pass whose rows mix a forced token, a few digits (no more than top-k) and a string's
    many tokens: the sketch's estimate runs for the string's row alone, the other two read all
    their allowed rows, and every kept logit is the whole head's."""
    with streamed_head(smollm2) as (x, full, weights, head):
        vocab = full.shape[1]
        forced, digits, many = np.zeros((3, vocab), bool)                 # (vocab,) each
        forced[123] = True
        digits[np.arange(500, 540)] = True                                # 40 = top-k
        many[1000:8000] = True
        seen, estimate = [], head.estimate
        head.estimate = lambda xs: seen.append(len(xs)) or estimate(xs)
        out = head.logits(x[3:6], [np.array([], np.int64)] * 3, False,
                          allowed=[forced, many, digits])                 # (3, vocab)
        assert seen == [1] and head.allowed_only == 2 and head.sketch_read > 0
        kept, whole = np.isfinite(out), weights.output(x[3:6])           # (3, vocab) each
        assert (kept[0] >= forced).all() and (kept[2] >= digits).all()
        top = np.flatnonzero(many)[np.argsort(-full[4][many])[:40]]       # row 1's allowed top 40
        assert kept[1, top].all() and head.fallbacks == 0
        np.testing.assert_array_equal(out[kept], whole[kept])
        head.logits(x[6:8], [np.array([], np.int64)] * 2, False, allowed=[forced, digits])
        assert seen == [1] and head.allowed_only == 4        # no row to rank: no sketch at all


@pytest.mark.realmodel
def test_budget_run_skips_the_sketch_and_writes_the_whole_heads_text(smollm2, monkeypatch):  # noqa: F811
    args = [str(smollm2.path), "-p", "A JSON record of a fictional sailmaker:", "-n", "48",
            "--temp", "0", "--dram-budget", "180MiB", "-j", json.dumps(SCHEMAS["numbers"])]
    full = cli(*args, "--no-sparse-head", "--no-timings", monkeypatch=monkeypatch)
    sparse = cli(*args, "--sparse-head", "--stats", "--json", monkeypatch=monkeypatch)
    free = cli(*args[:-2], "--sparse-head", "--stats", "--json", monkeypatch=monkeypatch)
    assert full.exit_code == 0 and sparse.exit_code == 0 and free.exit_code == 0, sparse.output
    assert sparse.stdout == full.stdout
    json.loads(sparse.stdout)
    got, ref = (json.loads(r.stderr.strip().splitlines()[-1])["flash"]["dense"]
                for r in (sparse, free))
    assert got["head_allowed_only"] > 0 and ref["head_allowed_only"] == 0
    per = lambda h: (h["head_sketch_bytes"] + 4096 * h["head_pages"]) / h["head_tokens"]  # noqa
    assert per(got) < per(ref), (got, ref)
