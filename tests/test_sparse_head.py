"""The output head's sketch (convert/head_sketch.py) and the sparse head (runtime/sparse_head.py).

The sketch's bytes are checked through gguf-py's Q2_K dequantization (an independent reader of the
format) and its stored error against the error of those values. The sparse head runs on a real
model's hidden states over held-out text: its candidates must hold the full head's argmax and
top-k, its logits there must be the full head's bit for bit, and greedy text through the CLI must
equal the full head's.
"""
import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from typer.testing import CliRunner

from flashllm.cli.app import app
from flashllm.convert.head_sketch import build
from flashllm.format.reader import open_flash
from flashllm.generation.sampler import SamplerParams
from flashllm.runtime import budget
from flashllm.runtime.model import Model
from flashllm.runtime.sparse_head import HeadNeed, SparseHead, head_need, sketch_bytes
from flashllm.runtime.weights import DenseWeights

MiB = 1 << 20


def test_sketch_is_q2_k_with_its_mean_squared_error():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((300, 700)) * rng.uniform(0.01, 2, (300, 1))).astype(np.float32)
    w[5] = 0.0                                                            # an all-zero row
    w[6, :300] = 0.25                                                     # flat sub-blocks
    sketch, var = build(w)
    assert sketch.dtype == "q2_k" and (sketch.rows, sketch.cols) == (300, 768)
    back = dequantize(sketch.data, Q.Q2_K).reshape(300, 768).astype(np.float64)  # (300, 768)
    assert np.all(back[:, 704:] == 0) and np.all(back[5] == 0)
    padded = np.zeros((300, 768))
    padded[:, :700] = w
    mse = ((back - padded) ** 2).reshape(300, 3, 256).mean(-1)            # (300, 3)
    np.testing.assert_allclose(var.data.view(np.float32).reshape(300, 3), mse, rtol=1e-5,
                               atol=1e-12)
    assert np.linalg.norm(back - padded) / np.linalg.norm(padded) < 0.4   # a 2.6-bit copy


def test_head_need_follows_the_sampler():
    assert head_need(SamplerParams(temp=0)) == HeadNeed(1, 0.0, 0)
    assert head_need(SamplerParams(top_k=40)) == HeadNeed(40, 0.0, 0)
    assert head_need(SamplerParams(top_k=0, top_p=1.0, min_p=0.1)) == \
        HeadNeed(0, -math.log(0.1), 0)
    assert head_need(SamplerParams(top_k=0, top_p=0.9)) is None           # any token may stay
    assert head_need(SamplerParams(top_k=0, top_p=1.0, min_p=0.0)) is None
    assert head_need(SamplerParams(temp=0, repeat_penalty=1.1, repeat_last_n=32)).recent == 32


@pytest.fixture(scope="module")
def smollm2():
    from conftest import _converted
    return open_flash(_converted("smollm2-135m", "native", log=lambda m: None))


def hidden_and_logits(flash, n: int = 192):
    """(x (n, d), the full head's logits (n, vocab)) over held-out code and prose."""
    from flashllm.generation.tokenizer import Tokenizer
    from flashllm.sparsity.calibrate import text_tokens
    from flashllm.sparsity.corpus import builtin_text
    tok = Tokenizer.from_flash(flash)
    ids = np.array(sum((text_tokens(tok, builtin_text("evaluation", k, 20000).text, n // 2)
                        for k in ("code", "prose")), []), np.int32)    # (n,)
    net = Model(flash, n_threads=2, n_ctx=n, weights=DenseWeights(flash, 2))  # rows as stored:
    # the kernels of a streamed head (a run without a budget packs the head: other sums' order)
    got = []
    real = net.w.output
    net.w.output = lambda x, exact=False: (got.append(x.copy()), real(x, exact))[1]
    logits = net.forward(ids, 0)                                         # (n, vocab)
    return got[0], logits, net.w


@pytest.mark.realmodel
def test_candidates_hold_greedy_and_top_k_and_are_exact(smollm2):
    x, full, weights = hidden_and_logits(smollm2)
    head = SparseHead(smollm2, weights, HeadNeed(1), n_threads=2)
    head.exact_dims(x[1:])              # as a run would, from hidden states past the first token
    vocab = full.shape[1]
    sizes = {1: [], 40: []}
    hi, lo = head.bounds(x)                                               # (n, vocab) each
    for k in (1, 40):
        for t in range(len(x)):
            cand = head.candidates(hi[t], lo[t], HeadNeed(k))
            assert np.isin(np.argsort(-full[t])[:k], cand).all(), (k, t)
            sizes[k].append(len(cand))
    assert np.mean(sizes[1]) < 0.05 * vocab and np.mean(sizes[40]) < 0.4 * vocab, \
        (np.mean(sizes[1]), np.mean(sizes[40]))
    name = "output.weight" if smollm2.has("output.weight") else "token_embd.weight"
    w = smollm2.tensor(name)                    # the exact columns, against gguf-py's values
    ref = dequantize(np.asarray(w.data), Q[w.dtype.upper()])[:, head.dims]   # (vocab, k)
    np.testing.assert_array_equal(head.columns, ref.T.astype(np.float16))
    np.testing.assert_array_equal(head.col_max, np.abs(ref).max(axis=0))
    none = SparseHead(smollm2, weights, HeadNeed(1), n_threads=2)
    none.exact_dims(x[1:], share=1.0)           # no dim holds all the energy: nothing is read
    assert none.columns.shape == (0, vocab) and none.col_max.shape == (0,)
    hi, lo = none.bounds(x[:16])                                          # (16, vocab) each
    assert all(full[t].argmax() in none.candidates(hi[t], lo[t]) for t in range(16))
    from flashllm.ffi.reader import Reader
    streamed = DenseWeights(smollm2, 2, streamed=[name],
                            reader=Reader(smollm2.dense_file, n_threads=4, stage_bytes=1 << 18))
    head = SparseHead(smollm2, streamed, HeadNeed(1), n_threads=2)
    head.exact_dims(x[1:])
    out = head.logits(x[:3], [np.array([7, 9])] * 3, exact=False)        # (3, vocab)
    streamed.close()
    kept = np.isfinite(out)
    assert kept[:, [7, 9]].all() and (out[~kept] == -np.inf).all()
    whole = weights.output(x[:3])                                         # (3, vocab) as a pass of 3
    np.testing.assert_array_equal(out[kept], whole[kept])                # the same rows, bit for bit
    assert (out.argmax(1) == whole.argmax(1)).all()


@pytest.mark.realmodel
def test_candidates_ranked_without_the_eog_tokens_hold_the_banned_samplers_top(smollm2):
    """--ignore-eos: a sampler never draws the end-of-generation tokens, so the candidates are
    ranked without them and hold the top k of the logits with theirs -inf — also where an EOG
    token would outrank every row (its bounds raised here), which alone would be the greedy
    candidate of a head that ranked it."""
    x, full, weights = hidden_and_logits(smollm2, 64)
    eog = np.array(smollm2.config.eos_token_ids)                          # (e,)
    full[:, eog] = -np.inf
    head = SparseHead(smollm2, weights, HeadNeed(1, no_eog=True), n_threads=2)
    head.exact_dims(x[1:])
    hi, lo = head.bounds(x)                                               # (n, vocab) each
    for t in range(len(x)):
        up, down = hi[t].copy(), lo[t].copy()                             # (vocab,) each
        up[eog] = down[eog] = 1e9
        assert set(head.candidates(up, down, HeadNeed(1)).tolist()) == set(eog.tolist())
        for k in (1, 40):
            for h, l in ((hi[t], lo[t]), (up, down)):
                cand = head.candidates(h, l, HeadNeed(k, no_eog=True))
                assert np.isin(np.argsort(-full[t])[:k], cand).all(), (k, t)
                assert not np.isin(eog, cand).any()


def cli(*args, monkeypatch):
    monkeypatch.setattr(budget, "process_rss", lambda: 100 * MiB)
    return CliRunner().invoke(app, ["run", *args])


@pytest.mark.realmodel
def test_cli_sparse_head_writes_the_full_heads_text(smollm2, monkeypatch):
    """Under a budget that streams the (tied) head, greedy decoding writes the same text with the
    sparse head as with the whole head, and --stats says what it read. (Seeded sampling is not
    compared as text: the sketch's DRAM changes the caches, so the FFN sums in another order,
    and top-p's cut is discontinuous in the logits; test_candidates_hold... covers top-k.)"""
    args = [str(smollm2.path), "-p", "The capital of France is Paris. The capital of Germany is",
            "-n", "24", "--temp", "0", "--dram-budget", "180MiB"]
    full = cli(*args, "--no-sparse-head", "--no-timings", monkeypatch=monkeypatch)
    sparse = cli(*args, "--sparse-head", "--stats", monkeypatch=monkeypatch)
    auto = cli(*args, "--stats", monkeypatch=monkeypatch)   # uncalibrated: nothing measured
    assert full.exit_code == 0 and sparse.exit_code == 0, sparse.output
    assert sparse.stdout == full.stdout
    assert "head sketch" in sparse.stderr and "sparse head:" in sparse.stderr
    assert "head sketch" not in full.stderr and "head sketch" not in auto.stderr


EOS_PROMPT = ("<|im_start|>user\nWhat is the capital of France? Answer in one word.<|im_end|>\n"
              "<|im_start|>assistant\n")


@pytest.mark.realmodel
def test_cli_ignore_eos_makes_its_n_tokens(smollm2, monkeypatch):
    """Where greedy decoding ends on the end-of-turn token after a few tokens, --ignore-eos
    (llama.cpp's) makes the -n tokens, those few first; under a budget the sparse head, ranked
    without the end-of-generation tokens, writes the whole head's text."""
    import json
    args = [str(smollm2.path), "-p", EOS_PROMPT, "-n", "24", "--temp", "0", "--json"]
    gen = lambda r: json.loads(r.stderr.strip().splitlines()[-1])          # noqa: E731
    plain = cli(*args, monkeypatch=monkeypatch)
    ignored = cli(*args, "--ignore-eos", monkeypatch=monkeypatch)
    assert plain.exit_code == 0 and ignored.exit_code == 0, ignored.output
    assert gen(plain)["stopped"] and gen(plain)["n_gen"] < 24
    assert not gen(ignored)["stopped"] and gen(ignored)["n_gen"] == 24
    assert ignored.stdout.startswith(plain.stdout) and len(ignored.stdout) > len(plain.stdout)
    budget = [*args, "--ignore-eos", "--dram-budget", "180MiB"]
    sparse = cli(*budget, "--sparse-head", monkeypatch=monkeypatch)
    whole = cli(*budget, "--no-sparse-head", monkeypatch=monkeypatch)
    assert sparse.exit_code == 0 and whole.exit_code == 0, sparse.output
    assert sparse.stdout == whole.stdout and gen(sparse)["n_gen"] == gen(whole)["n_gen"] == 24


def test_plan_streams_the_head_sparsely_only_when_it_reads_less(smollm2):
    man = smollm2.manifest
    assert sketch_bytes(man) == (0, 0)               # uncalibrated: planned only when forced
    sk = sketch_bytes(man, forced=True)
    assert sk[0] > 0 and sk[1] > 0
    tight = budget.plan_budget(man, budget.parse_budget("180MiB"), 256, 100 * MiB, sketch=sk)
    assert tight.sparse_head and tight.resident["head sketch"] == sk[0]
    plain = budget.plan_budget(man, budget.parse_budget("180MiB"), 256, 100 * MiB)
    assert not plain.sparse_head and "head sketch" not in plain.resident
    assert tight.streamed_bytes < plain.streamed_bytes
    roomy = budget.plan_budget(man, budget.parse_budget("2GiB"), 256, 100 * MiB, sketch=sk)   # the head stays resident
    assert not roomy.sparse_head and "head sketch" not in roomy.resident


def test_planned_reads_are_what_calibration_measured(smollm2):
    """The planner's bytes a token: the sketch plus the candidate rows calibration measured for
    a sampler keeping as many logits or fewer; nothing measured for it: no sparse head unless
    forced (then HEAD_ROWS_READ)."""
    from flashllm.runtime.sparse_head import HEAD_ROWS_READ
    man = smollm2.manifest
    sketch = smollm2.dense_entry("output_sketch.weight")["nbytes"]
    forced = sketch_bytes(man, forced=True)
    assert forced[1] == sketch + HEAD_ROWS_READ
    measured = {**man, "sparsity": {**man.get("sparsity", {}), "head": {
        "greedy": {"bytes": 1000}, "top40": {"bytes": 90000}}}}
    assert sketch_bytes(measured, top=1) == (forced[0], sketch + 1000)
    assert sketch_bytes(measured, top=20)[1] == sketch + 90000       # top-40 bounds top-20's
    assert sketch_bytes(measured, top=50) == (0, 0)                  # not measured
    assert sketch_bytes(measured, top=0) == (0, 0)                   # min-p: not measured
    assert sketch_bytes(measured, 4096, top=1)[0] == forced[0] + 1000  # staging the rows fill
    assert sketch_bytes(measured, 4096, top=40)[0] == forced[0] + 4096


@pytest.mark.realmodel
def test_measured_reads_follow_the_candidates(smollm2):
    """measure_reads counts, per position, the pages of the rows bounds_of leaves (or the whole
    head past MAX_READ_SHARE): recounted here from the candidates of the same bounds."""
    from flashllm.runtime.sparse_head import MAX_READ_SHARE, PAGE, measure_reads
    x, _, weights = hidden_and_logits(smollm2, 64)
    got = measure_reads(smollm2, weights, x, 2)
    head = SparseHead(smollm2, weights, HeadNeed(1), n_threads=2)
    head.exact_dims(x[32:33])
    hi, lo = head.bounds(x)
    for k, key in ((1, "greedy"), (40, "top40")):
        rows, spent = [], []
        for t in range(len(x)):
            cand = head.candidates(hi[t], lo[t], HeadNeed(k))
            b = head.pages_of(cand) * PAGE
            rows.append(len(cand))
            spent.append(head.head_bytes if b > MAX_READ_SHARE * head.head_bytes else b)
        assert got[key]["rows"] == round(float(np.mean(rows)), 1)
        assert got[key]["bytes"] == int(np.mean(spent))
    assert got["positions"] == 64 and got["top40"]["rows"] >= got["greedy"]["rows"] >= 1
