"""Continuous batching: a decode pass over several streams (runtime/batch.py) gives each
stream the logits it gets alone, bit for bit (dense and streamed FFN, quantized weights: their
int8 tiles give every token its one-token numbers; f32 / f16 weights' 4x4 float tiles sum in
another order from 4 rows on); through the server, a greedy request's answer does not depend
on what else is in flight; a budget must hold every stream's KV cache."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from flashllm.convert.convert import convert_source
from flashllm.format.reader import open_flash
from flashllm.format.manifest import read_manifest
from flashllm.runtime.assemble import make_parts
from flashllm.runtime.plan import FlashOptions, choose_plan
from flashllm.runtime.batch import pass_rows, verify_rows
from flashllm.runtime.model import Model
from serve_helpers import ROOT
from tiny_sources import ArraySource, tiny_arrays, tiny_config


QUANT = dict(d_model=128, n_heads=4, n_kv_heads=2, head_dim=32, n_ff=256)   # rows of 32s


@pytest.fixture(scope="module", params=["q8_0", "q4_0"])
def folder(tmp_path_factory, request):
    cfg = tiny_config(context_length=256, **QUANT)
    return convert_source(ArraySource(cfg, tiny_arrays(cfg, seed=3)),
                          tmp_path_factory.mktemp("batch") / "m", request.param)


def _nets(folder, n: int, naive=False, cache=None):
    flash = open_flash(folder)
    fopts = FlashOptions(None, naive=naive, keep_tokenizer=True)
    plan = choose_plan(read_manifest(folder), fopts, 64 * n, 0).plan
    ffn, weights, _ = make_parts(flash, fopts, plan, None, 1, cache)
    return [Model(flash, n_threads=1, n_ctx=64, ffn=ffn, weights=weights, kv_dtype="f16")
            for _ in range(n)], [ffn, weights]


@pytest.mark.parametrize("naive", [False, True])
def test_a_batched_pass_gives_each_stream_its_own_logits(folder, tmp_path, naive):
    """Four prompts of different lengths prefilled, then 6 greedy tokens decoded together,
    against each stream alone through Model.forward (`run`'s path): the same logits, bit for
    bit. Prompts of up to 10 tokens in all batch exactly too (the FFN's panels start above)."""
    prompts = [[1, 2, 3], [5, 6, 7], [4], [10, 11]]
    runs = []
    for batched in (False, True):
        nets, parts = _nets(folder, 4, naive=naive, cache=tmp_path)
        if batched:
            seen = [pass_rows(nets, prompts, [0] * 4, prefill=True)]     # (4, vocab)
        else:
            seen = [np.stack([n.forward(np.array(p, np.int32), 0, last_only=True)[0]
                              for n, p in zip(nets, prompts)])]          # (4, vocab)
        last, pos = [int(np.argmax(r)) for r in seen[0]], [len(p) for p in prompts]
        for _ in range(6):
            if batched:
                rows = pass_rows(nets, [[t] for t in last], pos)          # (4, vocab)
            else:
                rows = np.stack([n.forward(np.array([t], np.int32), p)[0]
                                 for n, t, p in zip(nets, last, pos)])   # (4, vocab)
            seen.append(rows)
            last, pos = [int(np.argmax(r)) for r in rows], [p + 1 for p in pos]
        runs.append(np.stack(seen))                                       # (7, 4, vocab)
        for part in parts:
            if part is not None:
                part.close()
    assert np.array_equal(runs[0], runs[1])


@pytest.mark.parametrize("naive", [False, True])
def test_a_pass_of_draft_guesses_gives_each_stream_its_own_rows(folder, tmp_path, naive):
    """Three streams' fed tokens with draft guesses and siblings in one pass of 9 rows
    (runtime/batch.verify_rows, what serve runs when it drafts), against each stream's own
    verifying pass through Model.forward (`run`'s decode_pass): every row's logits bit for
    bit; a kept sibling's keys and values enter its stream's cache as forward's do, so the
    next tokens' logits agree too."""
    prompts = [[1, 2, 3], [5, 6, 7, 8], [4]]
    chunks = [[9, 10, 11, 12], [13, 14], [15, 16, 17]]   # fed token, guesses, then a sibling
    sibs = [[2], [], [1]]            # stream 0's sibling stands at its pos + 2, stream 2's + 1
    keep = [(0, 2), None, (0, 1)]    # (sibling kept, its offset)
    runs = []
    for batched in (False, True):
        nets, parts = _nets(folder, 3, naive=naive, cache=tmp_path)
        pos = [len(p) for p in prompts]
        if batched:
            pass_rows(nets, prompts, [0] * 3, prefill=True)
            rows = verify_rows(nets, chunks, pos, sibs)                  # [(T_b, vocab)]
        else:
            for n, p in zip(nets, prompts):
                n.forward(np.array(p, np.int32), 0, last_only=True)
            rows = [n.forward(np.array(c, np.int32), p, siblings=s)     # (T_b, vocab)
                    for n, c, p, s in zip(nets, chunks, pos, sibs)]
        for n, p, k in zip(nets, pos, keep):
            if k is not None:
                n.keep_sibling(k[0], p + k[1])
        after = [p + 1 + (k[1] if k else len(c) - 1) for p, k, c in zip(pos, keep, chunks)]
        nxt = pass_rows(nets, [[18], [19], [20]], after) if batched else np.stack(
            [n.forward(np.array([t], np.int32), p)[0]
             for n, t, p in zip(nets, (18, 19, 20), after)])              # (3, vocab)
        runs.append((rows, nxt))
        for part in parts:
            if part is not None:
                part.close()
    (alone, a_next), (together, t_next) = runs
    assert [r.shape[0] for r in together] == [4, 2, 3]
    assert all(np.array_equal(a, t) for a, t in zip(alone, together))
    assert np.array_equal(a_next, t_next)


def test_the_budget_holds_every_stream_and_names_the_least(folder):
    def serve(parallel: int) -> str:
        out = subprocess.run([sys.executable, "-m", "flashllm", "serve", str(folder),
                              "--dram-budget", "64KiB", "--parallel", str(parallel), "-c",
                              "4096"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 1
        assert f"--parallel {parallel} streams" in out.stderr, out.stderr
        return out.stderr.split("the least --dram-budget that works for this model and "
                                "context: ")[1].split(")")[0]

    from flashllm.units import parse_size
    kv = 2 * 2 * 2 * 32 * 2 * 4096           # a stream's f16 keys and values: 2 MiB
    assert parse_size(serve(8)) - parse_size(serve(1)) >= 7 * kv - (2 << 20)


openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")


def test_a_greedy_answer_is_the_same_alone_and_among_three_others(tmp_path):
    """A short prompt and a long one (prefilled in chunks) answer greedily alone, then (on a
    fresh server: no KV cache to reuse) each among three other requests in flight: the same
    answers; the decode passes carried several streams."""
    import httpx
    from serve_helpers import Served, build_tiny
    from test_serve import PROMPT, client
    tiny = build_tiny(tmp_path / "tiny", "q8_0", **QUANT)
    args = ("--parallel", "4", "-c", "1024", "-t", "1")
    long = "how are you fine thanks a b c " * 80                     # 640 tokens
    ask = dict(model="tiny", max_tokens=200, temperature=0)
    served = Served(tiny, *args)
    try:
        alone = {p: client(served).completions.create(prompt=p, **ask).choices[0].text
                 for p in (PROMPT, long)}
    finally:
        assert served.stop() == 0, served.output()
    served = Served(tiny, *args)
    try:
        results = {}

        def one(prompt):
            results[prompt] = client(served).completions.create(prompt=prompt, **ask)

        prompts = [PROMPT, long, "a b c", "fine thanks"]
        threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        health = httpx.get(served.url + "/health").json()
        assert health["decode_rows"] / health["decode_passes"] > 1.5, health   # together
        assert {p: results[p].choices[0].text for p in alone} == alone
        assert results[long].usage.prompt_tokens == 640
        assert all(results[p].usage.completion_tokens == 200 for p in prompts)
        assert all(results[p].usage.prompt_tokens_details.cached_tokens == 0 for p in prompts)
    finally:
        assert served.stop() == 0, served.output()


def test_the_next_turn_of_a_chat_prefills_only_what_is_new(tmp_path):
    """Turn 2 of a chat (turn 1 and its answer, then a new message) starts with what a stream's
    KV cache holds: only the rest is prefilled (usage's cached_tokens), and the answer is the
    one a whole prefill of the conversation gives (generation.generate, as `run` prefills)."""
    from flashllm.generation.generate import generate
    from flashllm.generation.sampler import Sampler, SamplerParams
    from flashllm.generation.tokenizer import Tokenizer
    from flashllm.serve.model import chat_template
    from serve_helpers import Served, build_tiny
    from test_serve import client
    tiny = build_tiny(tmp_path / "tiny", "q8_0", **QUANT)
    served = Served(tiny, "--parallel", "2", "-c", "256", "-t", "1")
    try:
        c = client(served)
        turn = [{"role": "system", "content": "hello there"},
                {"role": "user", "content": "how are you"}]
        first = c.chat.completions.create(model="tiny", messages=turn, max_tokens=8,
                                          temperature=0)
        turn += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "fine thanks a b c"}]
        second = c.chat.completions.create(model="tiny", messages=turn, max_tokens=8,
                                           temperature=0)
    finally:
        assert served.stop() == 0, served.output()
    flash = open_flash(tiny)
    tok = Tokenizer.from_flash(flash)
    ids = tok.encode(chat_template(flash, tok).render(turn), add_special=False)
    made: list = []
    generate(Model(flash, n_threads=1, n_ctx=256, kv_dtype="f16"), Sampler(SamplerParams(temp=0)),
             ids, 8, on_token=made.append)
    assert second.choices[0].message.content == tok.decode(made)
    cached = second.usage.prompt_tokens_details.cached_tokens
    held = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert first.usage.prompt_tokens <= cached <= held and cached < len(ids)
    assert first.usage.prompt_tokens_details.cached_tokens == 0


def test_the_streams_share_one_ffn_and_one_set_of_weights(tmp_path):
    """All in DRAM (no budget: Model builds its own FFN and weights when given none), the
    streams the session assembles for a server still hold one copy: only their KV caches are
    their own."""
    from flashllm.session.run import Drafting, RunRequest, assemble
    from serve_helpers import build_tiny
    tiny = build_tiny(tmp_path / "tiny", "q8_0", **QUANT)
    req = RunRequest(tiny, FlashOptions(None, keep_tokenizer=True), None, 1, 64,
                     Drafting(0, "lookup"), 0, None, streams=3)
    parts = assemble(req, tmp_path, lambda m: None)
    nets = parts.nets
    assert nets[0] is parts.net and [n.n_ctx for n in nets] == [64] * 3
    assert len({id(n.ffn) for n in nets}) == len({id(n.w) for n in nets}) == 1
    assert len({id(n.k_cache) for n in nets}) == len({id(n.v_cache) for n in nets}) == 3
    assert len({id(n.fed) for n in nets}) == 3
