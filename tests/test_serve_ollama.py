"""serve's Ollama routes on the real server (the tiny model): /api/generate and /api/chat give
the greedy answers the OpenAI routes and `run` give (NDJSON streamed by default, one object with
stream false), options and errors as Ollama has them, /api/tags, /api/show, /api/ps and
/api/version; and the `ollama` client library (when installed) reads them all."""
from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from test_serve import PROMPT, chat_answer, run_cli, server, tiny  # noqa: E402,F401 (fixtures)

CHAT = [{"role": "system", "content": "hello there"}, {"role": "user", "content": "how are you"}]


def lines(served, path: str, body: dict) -> list:
    """The NDJSON objects of a streamed answer."""
    with httpx.stream("POST", served.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith(
            "application/x-ndjson")
        return [json.loads(line) for line in r.iter_lines() if line]


def test_generate_raw_is_what_run_prints(server, tiny):
    want = run_cli(tiny, PROMPT, 12)
    body = {"model": "tiny", "prompt": PROMPT, "raw": True, "options": {"temperature": 0,
                                                                        "num_predict": 12}}
    got = lines(server, "/api/generate", body)
    assert "".join(o["response"] for o in got) == want
    assert [o["done"] for o in got] == [False] * (len(got) - 1) + [True]
    last = got[-1]
    assert last["done_reason"] == "length" and last["eval_count"] == 12
    assert last["prompt_eval_count"] == 5 and last["total_duration"] > 0
    whole = httpx.post(server.url + "/api/generate", json={**body, "stream": False},
                       timeout=120).json()
    assert whole["response"] == want and whole["done"] and whole["eval_count"] == 12
    assert 0 < whole["prompt_eval_duration"] < whole["total_duration"]
    assert 0 < whole["eval_duration"] < whole["total_duration"]


def test_chat_is_what_run_i_answers(server, tiny):
    want = chat_answer(tiny, CHAT, 10)
    body = {"model": "tiny:latest", "messages": CHAT, "options": {"temperature": 0,
                                                                  "num_predict": 10}}
    got = lines(server, "/api/chat", body)
    assert "".join(o["message"]["content"] for o in got) == want
    assert all(o["message"]["role"] == "assistant" for o in got)
    whole = httpx.post(server.url + "/api/chat", json={**body, "stream": False},
                       timeout=120).json()
    assert whole["message"]["content"] == want and whole["done_reason"] == "length"
    gen = httpx.post(server.url + "/api/generate", timeout=120, json={
        "model": "tiny", "system": "hello there", "prompt": "how are you", "stream": False,
        "options": {"temperature": 0, "num_predict": 10}}).json()
    assert gen["response"] == want                 # prompt + system: the same chat


def test_options_seed_stop_and_logprobs(server):
    body = {"model": "tiny", "prompt": PROMPT, "raw": True, "stream": False,
            "options": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                        "seed": 5, "num_predict": 8, "num_ctx": 99, "mirostat": 0}}
    a = httpx.post(server.url + "/api/generate", json=body, timeout=120).json()
    b = httpx.post(server.url + "/api/generate", json=body, timeout=120).json()
    assert a["response"] == b["response"] and a["eval_count"] == 8
    words = a["response"].split()
    cut = httpx.post(server.url + "/api/generate", timeout=120, json={
        **body, "options": {**body["options"], "stop": [" " + words[2]]}}).json()
    assert cut["response"] == a["response"][:a["response"].index(" " + words[2])]
    assert cut["done_reason"] == "stop"
    lp = httpx.post(server.url + "/api/chat", timeout=120, json={
        "model": "tiny", "messages": CHAT, "stream": False, "logprobs": True,
        "top_logprobs": 2, "options": {"temperature": 0, "num_predict": 4}}).json()
    assert len(lp["logprobs"]) == 4
    assert all(e["logprob"] == e["top_logprobs"][0]["logprob"] for e in lp["logprobs"])


def test_listing_show_version_and_errors(server):
    tags = httpx.get(server.url + "/api/tags").json()["models"]
    assert [m["name"] for m in tags] == ["tiny:latest"] and tags[0]["size"] > 0
    assert httpx.get(server.url + "/api/ps").json()["models"][0]["model"] == "tiny:latest"
    show = httpx.post(server.url + "/api/show", json={"model": "tiny"}).json()
    assert "<|im_start|>" in show["template"] and show["capabilities"] == ["completion"]
    assert httpx.get(server.url + "/api/version").json()["version"]
    assert httpx.get(server.url + "/").text == "Ollama is running"
    load = httpx.post(server.url + "/api/generate", json={"model": "tiny"}).json()
    assert load["done"] and load["done_reason"] == "load"
    for path, body, status in [("/api/chat", {"model": "llama3", "messages": CHAT}, 404),
                               ("/api/chat", {"messages": CHAT}, 400),
                               ("/api/chat", {"model": "tiny", "messages": "hi"}, 400),
                               ("/api/generate", {"model": "tiny", "prompt": "a",
                                                  "options": {"temperature": "hot"}}, 400),
                               ("/api/generate", {"model": "tiny", "prompt": "a",
                                                  "format": "xml"}, 400),
                               ("/api/generate", {"model": "tiny", "prompt": "a",
                                                  "images": ["aGk="]}, 400),
                               ("/api/show", {"model": "nope"}, 404)]:
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == status, (body, r.text)
        assert set(r.json()) == {"error"} and r.json()["error"]


def test_the_ollama_client_reads_every_route(server, tiny):
    ollama = pytest.importorskip("ollama")
    c = ollama.Client(host=server.url)
    assert [m.model for m in c.list().models] == ["tiny:latest"]
    assert c.show("tiny").template and c.ps().models[0].name == "tiny:latest"
    want = chat_answer(tiny, CHAT, 10)
    opts = {"temperature": 0, "num_predict": 10}
    assert c.chat("tiny", messages=CHAT, options=opts).message.content == want
    parts = [p.message.content for p in c.chat("tiny", messages=CHAT, options=opts,
                                                stream=True)]
    assert "".join(parts) == want
    gen = c.generate("tiny", prompt=PROMPT, raw=True, options={"temperature": 0,
                                                               "num_predict": 12})
    assert gen.response == run_cli(tiny, PROMPT, 12) and gen.done_reason == "length"
    with pytest.raises(ollama.ResponseError) as e:
        c.chat("nope", messages=CHAT)
    assert e.value.status_code == 404
