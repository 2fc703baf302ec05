"""serve's logprobs and penalties on the tiny model, against a reference decode: the model's
logits pass by pass (runtime.Model, as `run -i`'s session runs it) with OpenAI's presence /
frequency formula and the log-softmax written out here in numpy (float64). Also: the
repeat penalty gives `run --repeat-penalty`'s text, and a template without tools is a 400."""
from __future__ import annotations

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from flashllm.format.reader import open_flash  # noqa: E402
from flashllm.generation.tokenizer import Tokenizer  # noqa: E402
from flashllm.runtime.model import Model  # noqa: E402
from test_serve import PROMPT, client, run_cli, server, tiny  # noqa: E402,F401 (fixtures)

CTX = 256


def reference(folder, prompt: str, n: int, presence: float = 0.0, frequency: float = 0.0,
              forced=None):
    """[(token, its logprob, {token: logprob} of all)] of n tokens after prompt: greedy over
    the penalized logits, or the tokens forced (ids) when given."""
    flash = open_flash(folder)
    tok = Tokenizer.from_flash(flash)
    model = Model(flash, n_threads=1, n_ctx=CTX, kv_dtype="f16")
    ids = tok.encode(prompt, add_special=True)
    logits = model.forward(ids, 0, last_only=True)[0]                    # (vocab,)
    made, out = [], []
    for i in range(n):
        z = logits.astype(np.float64)                                    # (vocab,)
        for t in set(made):
            z[t] -= made.count(t) * frequency + presence
        lp = z - (z.max() + np.log(np.exp(z - z.max()).sum()))           # (vocab,)
        t = int(np.argmax(lp)) if forced is None else forced[i]
        out.append((t, float(lp[t]), lp))
        made.append(t)
        logits = model.forward([t], len(ids) + i, last_only=True)[0]
    return tok, out


def test_completion_logprobs_and_penalties_are_the_reference_numbers(server, tiny):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 3,
            "presence_penalty": 1.5, "frequency_penalty": 2.0}
    got = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    lp = got["choices"][0]["logprobs"]
    tok, want = reference(tiny, PROMPT, 12, presence=1.5, frequency=2.0)
    assert lp["tokens"] == [tok.decode([t], skip_special=False) for t, _, _ in want]
    assert np.allclose(lp["token_logprobs"], [w for _, w, _ in want], atol=1e-3)
    for top, (_, _, row) in zip(lp["top_logprobs"], want):
        best = np.argsort(-row, kind="stable")[:3]
        assert list(top) == [tok.decode([int(i)], skip_special=False) for i in best]
        assert np.allclose(list(top.values()), row[best], atol=1e-3)
    plain = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 12, "temperature": 0}).json()["choices"][0]["text"]
    _, unpenalized = reference(tiny, PROMPT, 12)
    assert [t for t, _, _ in unpenalized] != [t for t, _, _ in want], "the penalty changed nothing"
    assert got["choices"][0]["text"] != plain
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_sampled_logprobs_are_before_the_temperature(server, tiny):
    """A sampled token's logprob is from the penalized distribution at temperature 1, whatever
    temperature drew it; streamed chunks carry the same numbers (to f32 rounding: the second
    request finds its prompt in a stream's KV cache)."""
    c = client(server)
    args = dict(model="tiny", messages=[{"role": "user", "content": "how are you"}],
                max_tokens=6, temperature=1.7, seed=11, logprobs=True, top_logprobs=2,
                extra_body={"top_k": 0, "top_p": 1.0, "min_p": 0.0})
    whole = c.chat.completions.create(**args).choices[0].logprobs.content
    streamed = [e for ch in c.chat.completions.create(**args, stream=True)
                if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in whole]
    assert np.allclose([e.logprob for e in streamed], [e.logprob for e in whole], atol=1e-5)
    assert len(whole) == 6
    from serve_helpers import WORDS
    from flashllm.generation.chat_template import CHATML, ChatTemplate
    prompt = ChatTemplate(CHATML).render([{"role": "user", "content": "how are you"}])
    forced = [WORDS.index(e.token.strip()) for e in whole]
    _, want = reference(tiny, prompt, 6, forced=forced)
    assert np.allclose([e.logprob for e in whole], [w for _, w, _ in want], atol=1e-3)
    for e, (_, _, row) in zip(whole, want):
        assert [t.logprob for t in e.top_logprobs] == sorted(
            [t.logprob for t in e.top_logprobs], reverse=True)
        assert np.isclose(e.top_logprobs[0].logprob, row.max(), atol=1e-3)
        assert bytes(e.bytes).decode() == e.token


def test_repeat_penalty_is_runs(server, tiny):
    want = run_cli(tiny, PROMPT, 12, "--repeat-penalty", "1.5", "--repeat-last-n", "8")
    got = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "repeat_penalty": 1.5,
        "repeat_last_n": 8}).json()
    assert got["choices"][0]["text"] == want


def test_tools_for_a_template_without_them_are_a_400_naming_the_model(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hello"}],
        "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools" and "`tiny` does not take tools" in err["message"]
