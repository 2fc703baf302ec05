"""serve's tool calls on Qwen2.5-Coder-0.5B through the official openai client: a forced call
("required", a named function, the SDK's pydantic tool helper) parses and its arguments
validate against the function's schema (jsonschema); streamed, the calls arrive as OpenAI streams
them and add up to the whole answer's; a tool's result in the conversation is answered; Ollama's
/api/chat gives the OpenAI route's calls and its `format` constrains the answer."""
from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from conftest import _converted  # noqa: E402
from serve_helpers import Served  # noqa: E402
from test_serve import client as openai_client  # noqa: E402
from test_serve_tools_text import TIME, WEATHER  # noqa: E402

MODEL = "qwen2.5-coder-0.5b-native"
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server():
    served = Served(_converted("qwen2.5-coder-0.5b", "native", log=lambda m: None),
                    "--parallel", "2", "-c", "2048", "-t", "2")
    yield served
    assert served.stop() == 0, served.output()


def client(served):
    return openai_client(served, timeout=600)


def schema_of(name: str) -> dict:
    return next(t for t in (WEATHER, TIME) if t["function"]["name"] == name)[
        "function"]["parameters"]


def check_calls(calls, names) -> list:
    """Each call names one of names and its arguments validate: [(name, arguments)]."""
    out = []
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, schema_of(call.function.name))
        out.append((call.function.name, args))
    return out


@pytest.mark.realmodel
def test_required_and_named_calls_validate(server):
    c = client(server)
    for seed in (1, 2):
        r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                      tool_choice="required", temperature=0.8, seed=seed,
                                      max_tokens=200)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        check_calls(choice.message.tool_calls, ("get_weather", "get_time"))
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                  tool_choice={"type": "function",
                                               "function": {"name": "get_time"}},
                                  temperature=0.8, seed=3, max_tokens=200)
    calls = check_calls(r.choices[0].message.tool_calls, ("get_time",))
    assert len(calls) == 1 and r.choices[0].finish_reason == "tool_calls"


@pytest.mark.realmodel
def test_streamed_calls_add_up_to_the_whole_answer(server):
    c = client(server)
    args = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                temperature=0, max_tokens=200)
    whole = c.chat.completions.create(**args).choices[0]
    calls, finish = {}, None
    for ch in c.chat.completions.create(**args, stream=True):
        delta = ch.choices[0].delta
        for tc in delta.tool_calls or []:
            if tc.id is not None:               # a call's first chunk: id, type and name
                assert tc.type == "function" and tc.function.name
                calls[tc.index] = {"name": tc.function.name, "arguments": ""}
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls]
    with c.chat.completions.stream(**args) as stream:          # the SDK's own accumulator
        final = stream.get_final_completion()
    assert [t.function.arguments for t in final.choices[0].message.tool_calls] == \
        [t.function.arguments for t in whole.message.tool_calls]


@pytest.mark.realmodel
def test_the_sdk_pydantic_tool_helper_parses_the_call(server):
    pydantic = pytest.importorskip("pydantic")

    class GetWeather(pydantic.BaseModel):
        city: str
        unit: str

    r = client(server).chat.completions.parse(
        model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required", temperature=0.8, seed=4, max_tokens=200)
    call = r.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, GetWeather)


@pytest.mark.realmodel
def test_auto_and_a_tool_result(server):
    c = client(server)
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0,
                                  max_tokens=200)
    choice = r.choices[0]
    if choice.message.tool_calls:                # greedy: the model decides; either way
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls, ("get_weather",))
    else:
        assert choice.message.content and "<tool_call>" not in choice.message.content
    call = {"id": "call_7", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_7",
                      "content": "{\"sky\": \"sunny\", \"celsius\": 21}"}]
    r = c.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                  tool_choice="none", temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert "21" in choice.message.content or "sunny" in choice.message.content.lower()


@pytest.mark.realmodel
def test_ollama_calls_and_format(server):
    c = client(server)
    want = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0,
                                     max_tokens=200).choices[0].message
    got = httpx.post(server.url + "/api/chat", timeout=600, json={
        "model": MODEL, "messages": ASK, "tools": [WEATHER], "stream": False,
        "options": {"temperature": 0, "num_predict": 200}}).json()["message"]
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in
            got.get("tool_calls", [])] == [(t.function.name, json.loads(t.function.arguments))
                                           for t in want.tool_calls or []]
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "country": {"type": "string"}},
              "required": ["city", "country"]}
    for seed in (1, 2):
        r = httpx.post(server.url + "/api/chat", timeout=600, json={
            "model": MODEL, "stream": False, "format": schema,
            "messages": [{"role": "user", "content": "Name a city and its country, as JSON."}],
            "options": {"temperature": 0.8, "seed": seed, "num_predict": 200}}).json()
        assert r["done_reason"] == "stop", r
        jsonschema.validate(json.loads(r["message"]["content"]), schema)
    r = httpx.post(server.url + "/api/generate", timeout=600, json={
        "model": MODEL, "stream": False, "format": "json", "prompt": "A JSON object of a dog.",
        "options": {"temperature": 0, "num_predict": 300}}).json()
    if r["done_reason"] == "stop":
        assert isinstance(json.loads(r["response"]), dict)
