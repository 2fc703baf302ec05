"""`flashllm serve`: the real server (a subprocess on a free loopback port) driven with the
official openai client and raw HTTP (httpx). Greedy answers are compared with `flashllm run`
(a subprocess) and with `run -i`'s chat session; bad input gets OpenAI's error shape with the
right status and never takes the server down."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from flashllm.format.reader import open_flash  # noqa: E402
from flashllm.generation.chat import ChatSession  # noqa: E402
from flashllm.generation.sampler import Sampler, SamplerParams  # noqa: E402
from flashllm.generation.tokenizer import Tokenizer  # noqa: E402
from flashllm.runtime.model import Model  # noqa: E402
from serve_helpers import ROOT, Served, build_tiny  # noqa: E402

PROMPT = "hello there how are you"
OTHERS = ["Once upon a time", "The capital of Italy is", "def add(a, b):"]   # a real model's
CTX = 2048


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A converted tiny model (f32) with a word-level tokenizer and ChatML (its folder)."""
    return build_tiny(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module")
def server(tiny):
    served = Served(tiny, "--parallel", "2", "-c", str(CTX), "-t", "1", "--queue-size", "8")
    yield served
    assert served.stop() == 0, served.output()


def client(served, key: str = "none", timeout: float = 120):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=key, max_retries=0,
                         timeout=timeout)


def run_cli(model, prompt: str, n: int, *extra: str) -> str:
    """What `flashllm run MODEL -p PROMPT -n N --temp 0 EXTRA...` writes to stdout (into a
    pipe: the tokens alone, no newline added)."""
    out = subprocess.run([sys.executable, "-m", "flashllm", "run", str(model), "-p", prompt,
                          "-n", str(n), "--temp", "0", "--no-timings", "-t", "1", *extra],
                         capture_output=True, text=True, timeout=1200, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    return out.stdout


def at_once(c, prompts: list, **ask) -> dict:
    """{prompt: its completion's text}, the prompts requested at the same time (a thread each)
    through the openai client c with ask's fields."""
    out = {}

    def one(p):
        out[p] = c.completions.create(prompt=p, **ask).choices[0].text

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def chat_answer(folder, messages: list, n: int) -> str:
    """The greedy answer `run -i` gives (its ChatSession) to the conversation's last message."""
    flash = open_flash(folder)
    tok = Tokenizer.from_flash(flash)
    from flashllm.serve.model import chat_template
    session = ChatSession(Model(flash, n_threads=1, n_ctx=CTX, kv_dtype="f16"), tok,
                          Sampler(SamplerParams(temp=0.0)), chat_template(flash, tok),
                          n_predict=n)
    session.messages = list(messages[:-1])
    pieces = []
    session.ask(messages[-1]["content"], pieces.append)
    return "".join(pieces)


def test_greedy_completion_is_what_run_prints(server, tiny):
    want = run_cli(tiny, PROMPT, 12)
    c = client(server)
    got = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.choices[0].text == want
    assert got.usage.prompt_tokens == 5 and got.usage.completion_tokens == len(want.split())
    assert got.choices[0].finish_reason == "length"
    streamed = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                    stream=True)
    chunks = list(streamed)
    assert "".join(ch.choices[0].text for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == got.choices[0].finish_reason


def test_greedy_chat_is_what_run_i_answers(server, tiny):
    messages = [{"role": "system", "content": "hello there"},
                {"role": "user", "content": "how are you"}]
    want = chat_answer(tiny, messages, 10)
    c = client(server)
    got = c.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                    temperature=0)
    assert got.choices[0].message.content == want
    assert got.choices[0].message.role == "assistant"
    streamed = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == want
    assert streamed[-1].usage.completion_tokens == got.usage.completion_tokens


def test_stop_strings_cut_the_text_before_them(server, tiny):
    c = client(server)
    full = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    text = full.choices[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    cut = text[:text.index(stop)]
    for stream in (False, True):
        got = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                   stop=[stop, "never"], stream=stream)
        if stream:
            got = list(got)
            assert "".join(ch.choices[0].text for ch in got) == cut
            assert got[-1].choices[0].finish_reason == "stop"
        else:
            assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats_and_models_and_health(server):
    c = client(server)
    ask = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, top_k=0,
               top_p=1.0, min_p=0.0, seed=7)
    ask = {k: v for k, v in ask.items() if k not in ("top_k", "min_p")}
    extra = {"top_k": 0, "min_p": 0.0}
    a = c.completions.create(**ask, extra_body=extra).choices[0].text
    b = c.completions.create(**ask, extra_body=extra).choices[0].text
    assert a == b
    assert [m.id for m in c.models.list().data] == ["tiny"]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["slots_idle"] == 2


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"prompt": 5}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "a", "max_tokens": "9"}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "a", "max_tokens": -1}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "a", "max_tokens": 10 ** 9}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "a", "max_tokens": True}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "a", "temperature": 3}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "a", "top_p": 0}).encode(), 400, "top_p"),
    (json.dumps({"prompt": "a", "stop": ["1", "2", "3", "4", "5"]}).encode(), 400, "stop"),
    (json.dumps({"prompt": "a", "stream": "yes"}).encode(), 400, "stream"),
    (json.dumps({"prompt": "a", "n": 2}).encode(), 400, "n"),
    (json.dumps({"prompt": "a", "model": "gpt-4"}).encode(), 404, "model"),
    (json.dumps({"prompt": "hello " * 200_000}).encode(), 400, "prompt"),   # 1.2 MB
    (b'{"prompt": "' + b"a" * (5 << 20) + b'"}', 413, None),
    (b"[" * 100_000, 400, None),            # nested past Python's stack: was a 500, a traceback
]


@pytest.mark.parametrize("body, status, param", BAD)
def test_bad_input_gets_an_openai_error(server, body, status, param):
    r = httpx.post(server.url + "/v1/completions", content=body, timeout=120,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert httpx.get(server.url + "/health").status_code == 200


def test_bad_chat_messages_unknown_routes_and_fields(server):
    post = lambda path, body: httpx.post(server.url + path, json=body, timeout=120)  # noqa: E731
    assert post("/v1/chat/completions", {"messages": []}).status_code == 400
    r = post("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert httpx.get(server.url + "/v1/completions").status_code == 405
    r = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "whatever": [1],
                                 "cache_prompt": True})          # unknown fields are ignored
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_a_client_that_drops_its_stream_frees_its_slot(server):
    body = {"prompt": PROMPT, "max_tokens": CTX - 10, "temperature": 1.0, "seed": 1,
            "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    t0 = time.monotonic()
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=300).json()
    full_s = time.monotonic() - t0
    assert whole["usage"]["completion_tokens"] == CTX - 10, whole["usage"]
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    t0 = time.monotonic()                                   # the connection is closed now
    while httpx.get(server.url + "/health").json()["slots_processing"]:
        assert time.monotonic() - t0 < full_s / 2, "the dropped stream kept its slot"
        time.sleep(0.02)


def test_fifty_requests_at_once_are_served_or_refused(server):
    results, health = [], []

    def one(i):
        try:
            r = httpx.post(server.url + "/v1/completions", timeout=300,
                           json={"prompt": PROMPT, "max_tokens": 4, "stream": i % 2 == 0})
            results.append((r.status_code, r.text))
        except httpx.HTTPError as e:
            results.append((0, repr(e)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        health.append(time.monotonic() - t0)
        time.sleep(0.05)
    for t in threads:
        t.join()
    codes = sorted(c for c, _ in results)
    assert set(codes) <= {200, 503} and codes.count(200) >= 10, results
    assert all(json.loads(t)["error"]["code"] == "busy" for c, t in results if c == 503)
    assert max(health) < 5.0


def test_api_key_warning_and_sigterm(tiny):
    served = Served(tiny, "--parallel", "1", "-c", "64", "-t", "1", "--api-key", "s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            client(served, "wrong").completions.create(model="tiny", prompt="a", max_tokens=1)
        r = httpx.get(served.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(served.url + "/health").status_code == 200
        got = client(served, "s3cret").completions.create(model="tiny", prompt="a",
                                                         max_tokens=2)
        assert got.usage.prompt_tokens == 1
        stream = client(served, "s3cret").completions.create(
            model="tiny", prompt=PROMPT, max_tokens=50, stream=True)
        next(iter(stream))
    finally:
        code = served.stop()
    assert code == 0 and "stopped" in served.output(), served.output()


def test_a_public_host_without_a_key_is_warned_about(tmp_path):
    out = subprocess.run([sys.executable, "-m", "flashllm", "serve", str(tmp_path / "nothing"),
                          "--host", "0.0.0.0"], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 1
    assert "warning: serving on 0.0.0.0 without --api-key" in out.stderr


def test_serve_without_the_extra_says_how_to_install_it(tmp_path):
    code = ("import sys; sys.modules['uvicorn'] = None; from flashllm.cli import main; "
            f"sys.argv = ['flashllm', 'serve', {str(tmp_path)!r}]; main()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "error: serve needs the `serve` extra: pip install 'flashllm[serve]' (starlette, "
        "uvicorn)"]


@pytest.mark.realmodel
def test_smollm2_answers_as_run_does():
    from conftest import gguf_path
    gguf = gguf_path("smollm2-135m")
    prompt = "The three primary colors are"
    want = run_cli(gguf, prompt, 24)                 # converts it once into the user cache
    served = Served(gguf, "--parallel", "4", "-c", "512", "-t", "1")
    try:
        c = client(served)
        got = c.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=24,
                                   temperature=0)
        assert got.choices[0].text == want
        streamed = c.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=24,
                                        temperature=0, stream=True)
        assert "".join(ch.choices[0].text for ch in streamed) == want
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        folder = _converted_folder(gguf)
        answer = chat_answer(folder, messages, 24)
        chat = c.chat.completions.create(model="smollm2-135m", messages=messages,
                                         max_tokens=24, temperature=0)
        assert chat.choices[0].message.content == answer and answer
        together = at_once(c, [prompt] + OTHERS, model="smollm2-135m", max_tokens=24,
                           temperature=0)     # alongside three others: the same answer
        assert together[prompt] == want
    finally:
        assert served.stop() == 0, served.output()


def test_a_drafting_server_answers_as_run_does_alone_and_among_three(tmp_path):
    """serve --draft 6 --draft-kind lookup (q8_0 weights: a row's sums are its own in a pass of
    up to 10 rows): a greedy answer is what `run` prints without drafting, alone and among
    three other requests in flight, and /health counts the guesses the passes checked and
    kept."""
    from test_serve_batch import QUANT
    tiny = build_tiny(tmp_path / "tiny", "q8_0", **QUANT)
    want = run_cli(tiny, PROMPT, 60)
    served = Served(tiny, "--parallel", "4", "-c", "256", "-t", "1", "--draft", "6",
                    "--draft-kind", "lookup")
    ask = dict(model="tiny", max_tokens=60, temperature=0)
    try:
        c = client(served)
        assert c.completions.create(prompt=PROMPT, **ask).choices[0].text == want
        alone = httpx.get(served.url + "/health").json()
        assert 0 < alone["draft_accepted"] <= alone["draft_proposed"], alone
        assert alone["decode_passes"] < 59, alone        # kept guesses: fewer passes than tokens
        from test_serve_logprobs import reference       # each token's logprobs: from its row
        lp = c.completions.create(prompt=PROMPT, logprobs=2, **ask).choices[0].logprobs
        _, ref = reference(tiny, PROMPT, 60)
        assert np.allclose(lp.token_logprobs, [w for _, w, _ in ref], atol=1e-3)
        assert httpx.get(served.url + "/health").json()["draft_accepted"] > \
            alone["draft_accepted"]
        together = at_once(c, [PROMPT, "a b c", "fine thanks", "how are you"], **ask)
        assert together[PROMPT] == want
        assert together["a b c"] == run_cli(tiny, "a b c", 60)
        health = httpx.get(served.url + "/health").json()
        assert health["draft_accepted"] > alone["draft_accepted"], health
    finally:
        assert served.stop() == 0, served.output()


@pytest.mark.realmodel
def test_smollm2_self_drafts_under_a_budget_as_run_does():
    """Under a --dram-budget whose caches hold part of the FFN, serve's streams draft with the
    model's resident part (--draft-kind self, as `run` drafts there): a greedy answer is what
    `run` prints under the budget, alone and among three other requests; /health counts the
    guesses checked and kept, and the process stays within the budget (VmHWM)."""
    from conftest import gguf_path
    from test_serve_memory import MiB, peak_rss
    gguf = gguf_path("smollm2-135m")
    prompt, budget = "The three primary colors are", 200
    want = run_cli(gguf, prompt, 24, "--dram-budget", f"{budget}MiB", "--draft-kind", "self")
    served = Served(gguf, "--parallel", "4", "-c", "256", "-t", "1", "--dram-budget",
                    f"{budget}MiB", "--draft-kind", "self")
    ask = dict(model="smollm2-135m", max_tokens=24, temperature=0)
    try:
        assert "drafting: self" in served.output(), served.output()
        c = client(served)
        assert c.completions.create(prompt=prompt, **ask).choices[0].text == want
        assert at_once(c, [prompt] + OTHERS, **ask)[prompt] == want
        health = httpx.get(served.url + "/health").json()
        assert 0 < health["draft_accepted"] <= health["draft_proposed"], health
        peak = peak_rss(served.proc.pid)
        assert peak <= budget * MiB, f"peak {peak / MiB:.1f} MiB over the {budget} MiB budget"
    finally:
        assert served.stop() == 0, served.output()


def _converted_folder(gguf):
    """Where `run GGUF` converted it (the user cache's)."""
    from flashllm.cli.app import cache_dir
    from flashllm.convert.resolve import resolve_model
    return resolve_model(str(gguf), cache_dir(), ROOT / "models.toml", log=lambda m: None)


def test_ctrl_c_stops_as_sigterm_does(tiny):
    import signal
    served = Served(tiny, "--parallel", "1", "-c", "64", "-t", "1")
    served.proc.send_signal(signal.SIGINT)
    assert served.proc.wait(60) == 0 and "stopped" in served.output(), served.output()
