"""serve's tool calls without a model: the prompt a chat with tools renders (against transformers'
own renderer of the same template), the calls read from an answer however it is streamed
(against a regular-expression reading of the whole text), and the requests refused."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from flashllm.generation.chat_template import CHATML, ChatTemplate
from flashllm.serve.api import ApiError, parse_ask
from flashllm.serve.tools import ToolText, render, split_answer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


def qwen_template() -> str:
    """Qwen2.5-Coder's chat template, as its GGUF carries it."""
    from conftest import gguf_path
    from gguf import GGUFReader
    field = GGUFReader(gguf_path("qwen2.5-coder-0.5b", lambda m: None)).fields[
        "tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


def conversation(arguments) -> list:
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 3}"}]


@pytest.mark.realmodel
def test_tools_render_as_transformers_renders_them():
    from transformers.utils.chat_template_utils import render_jinja_template
    source = qwen_template()
    ask = parse_ask({"messages": conversation('{"city": "Oslo"}'), "tools": [WEATHER, TIME]},
                    True, ("m",), 64)
    got = render(ChatTemplate(source), list(ask.messages), ask.tools, "m")
    want = conversation({"city": "Oslo"})
    want[2]["content"] = ""
    ref = render_jinja_template([want], tools=[WEATHER, TIME], chat_template=source,
                                add_generation_prompt=True)
    ref = ref[0] if isinstance(ref, tuple) else ref
    ref = ref[0] if isinstance(ref, list) else ref
    assert got == ref
    assert '"name": "get_time"' in got and '{"name": "get_weather", "arguments": ' \
        '{"city": "Oslo"}}' in got and "<tool_response>\n{\"temp\": 3}" in got
    none = parse_ask({"messages": conversation("{}"), "tools": [WEATHER],
                      "tool_choice": "none"}, True, ("m",), 64)
    assert "<tools>" not in render(ChatTemplate(source), list(none.messages), none.tools, "m")


def test_a_template_without_tools_is_a_400_naming_the_model():
    ask = parse_ask({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]},
                    True, ("m",), 64)
    with pytest.raises(ApiError) as e:
        render(ChatTemplate(CHATML), list(ask.messages), ask.tools, "smollm2-135m")
    assert e.value.status == 400 and e.value.param == "tools"
    assert "`smollm2-135m` does not take tools" in e.value.message


def test_bad_tools_and_choices_are_refused():
    user = [{"role": "user", "content": "hi"}]
    for extra, param in [({"tools": {"a": 1}}, "tools"),
                         ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
                         ({"tools": [{"type": "function", "function": {
                             "name": "f", "parameters": [1]}}]}, "tools"),
                         ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
                         ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {
                             "name": "nope"}}}, "tool_choice"),
                         ({"tool_choice": "required"}, "tool_choice"),
                         ({"tools": [WEATHER], "parallel_tool_calls": "no"},
                          "parallel_tool_calls"),
                         ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
                         ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                         ({"presence_penalty": -2.5}, "presence_penalty"),
                         ({"functions": [{"name": "f"}]}, "functions")]:
        with pytest.raises(ApiError) as e:
            parse_ask({"messages": user, **extra}, True, ("m",), 64)
        assert e.value.status == 400 and e.value.param == param, (extra, e.value.message)
    with pytest.raises(ApiError) as e:          # a tool message answers a call: it names it
        parse_ask({"messages": [{"role": "tool", "content": "x"}]}, True, ("m",), 64)
    assert e.value.param == "messages"


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
ANSWERS = ["Plain text, no call.\n", CALL, "Sure.\n" + CALL + "\n" + CALL.replace("Oslo", "Rome"),
           CALL + "\nDone.  ", "<tool_call> not json </tool_call> after",
           "a < b <tool_ca", '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}']


def reference(text: str) -> tuple:
    """The content and calls of a whole answer read with regular expressions: every
    <tool_call>JSON</tool_call> block (the last may be unclosed) whose JSON names a function is
    a call; the rest is content, stripped next to calls and at the end when there are calls."""
    parts = re.split(r"(<tool_call>.*?(?:</tool_call>|$))", text, flags=re.S)
    content, calls, prev_call = [], [], False
    for part in parts:
        m = re.fullmatch(r"<tool_call>(.*?)(?:</tool_call>)?", part, flags=re.S)
        obj = None
        if m:
            try:
                obj = json.loads(m.group(1))
            except ValueError:
                pass
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get("arguments", {})
            args = json.loads(args) if isinstance(args, str) else args
            calls.append((obj["name"], json.dumps(args)))
            if content:
                content[-1] = content[-1].rstrip()
            prev_call = True
        else:
            content.append(part.lstrip() if prev_call else part)
            prev_call = prev_call and not part.strip()
    text = "".join(content)
    return ((text.rstrip() or None), calls) if calls else (text, calls)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(ANSWERS), st.lists(st.integers(0, 200), max_size=8))
@example(ANSWERS[2], [3, 10, 11, 40]).via("a mark cut in three")
def test_streamed_calls_are_read_as_the_whole_answer(text, cuts):
    stream, events = ToolText(), []
    bounds = [0] + sorted(min(c, len(text)) for c in cuts) + [len(text)]
    for a, b in zip(bounds, bounds[1:]):
        events += stream.push(text[a:b])
    events += stream.flush()
    content = "".join(e[1] for e in events if e[0] == "content")
    calls = [e[1:] for e in events if e[0] == "call"]
    want = reference(text)
    assert ((content or None) if calls else content, calls) == want
    assert split_answer(text) == want


BARE = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'


@pytest.mark.parametrize("text, want", [
    (BARE, (None, [("get_weather", '{"city": "Paris", "unit": "C"}')])),
    ("\n " + BARE + "\n" + BARE.replace("Paris", "Rome"),
     (None, [("get_weather", '{"city": "Paris", "unit": "C"}'),
             ("get_weather", '{"city": "Rome", "unit": "C"}')])),
    (BARE + " and more", (BARE + " and more", [])),               # not calls alone: content
    (BARE.replace("get_weather", "rm_rf"), (BARE.replace("get_weather", "rm_rf"), [])),
    ('{"a": 1}', ('{"a": 1}', [])),
    ("The answer: " + BARE, ("The answer: " + BARE, [])),        # JSON after text: content
])
def test_an_answer_of_bare_call_objects_is_its_calls(text, want):
    """A small model may answer a call without the <tool_call> tags (Qwen2.5-Coder-0.5B does,
    greedy, to tests/test_serve_tools.py's question): an answer that is nothing but JSON
    objects naming the request's functions is read as their calls, streamed or whole."""
    names = ("get_weather", "get_time")
    assert split_answer(text, names) == want
    stream, events = ToolText(names), []
    for i in range(0, len(text), 3):
        events += stream.push(text[i:i + 3])
    events += stream.flush()
    content = "".join(e[1] for e in events if e[0] == "content")
    calls = [e[1:] for e in events if e[0] == "call"]
    assert ((content or None) if calls else content, calls) == want
