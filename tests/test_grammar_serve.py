"""`flashllm serve`'s response_format (json_object, json_schema) on SmolLM2 through the official
openai client: every answer parses and validates (jsonschema), two streams in one batch keep
their own schemas, a schema that does not compile is a 400 in OpenAI's error shape, and an
answer cut by max_tokens ends with finish_reason "length"."""
from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from conftest import _converted  # noqa: E402
from scripts.bench.grammar import PROMPTS, SCHEMAS  # noqa: E402
from serve_helpers import Served  # noqa: E402


@pytest.fixture(scope="module")
def server():
    served = Served(_converted("smollm2-135m", "native", log=lambda m: None),
                    "--parallel", "2", "-c", "1024", "-t", "1")
    yield served
    assert served.stop() == 0, served.output()


def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=300)


def ask(served, kind: str, subject: str, fmt: dict, seed: int, max_tokens: int = 200):
    return client(served).chat.completions.create(
        model="smollm2-135m-native", messages=[{"role": "user",
                                                "content": PROMPTS[kind].format(subject)}],
        response_format=fmt, temperature=0.8, seed=seed, max_tokens=max_tokens)


def schema_format(kind: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": kind, "schema": SCHEMAS[kind],
                                                   "strict": True}}


@pytest.mark.realmodel
def test_two_streams_each_keep_their_schema(server):
    got = {}

    def one(kind, seed):
        got[kind] = ask(server, kind, "a chess prodigy", schema_format(kind), seed)

    threads = [threading.Thread(target=one, args=(k, i)) for i, k in
               enumerate(["nested", "numbers"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for kind, r in got.items():
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[kind])


@pytest.mark.realmodel
def test_json_object_and_streaming(server):
    # json_object bounds no length: an answer either completes (stop) and parses, or is cut
    # (length); a sampled answer may run on, so a few seeds, at least one of them whole
    whole = 0
    for seed in (7, 8, 9):
        choice = ask(server, "object", "a ferry captain", {"type": "json_object"}, seed,
                     300).choices[0]
        assert choice.finish_reason in ("stop", "length"), choice
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
            whole += 1
    assert whole, "no json_object answer completed within 300 tokens"
    stream = client(server).chat.completions.create(
        model="smollm2-135m-native", messages=[{"role": "user", "content":
                                                PROMPTS["array"].format("a rainbow")}],
        response_format=schema_format("array"), temperature=0.8, seed=2, max_tokens=400,
        stream=True)
    pieces, finish = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    jsonschema.validate(json.loads("".join(pieces)), SCHEMAS["array"])
    assert finish == "stop"


@pytest.mark.realmodel
def test_bad_schema_is_a_400_and_a_cut_answer_says_length(server):
    with pytest.raises(openai.BadRequestError) as e:
        ask(server, "object", "a potter", {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}}, 1)
    err = e.value.body if isinstance(e.value.body, dict) else {}
    err = err.get("error", err)
    assert e.value.status_code == 400 and err.get("param") == "response_format"
    assert "does not compile" in err.get("message", "")
    with pytest.raises(openai.BadRequestError):
        ask(server, "object", "a potter", {"type": "xml"}, 1)
    r = ask(server, "nested", "a potter", schema_format("nested"), 1, max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)
