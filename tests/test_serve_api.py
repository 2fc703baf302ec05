"""The server's pure parts: stop strings over streamed text (against cutting the whole text at
the first stop string) and request checking (OpenAI's rules)."""
from __future__ import annotations

import pytest
from hypothesis import example, given, strategies as st

from flashllm.serve.api import ApiError, parse_ask
from flashllm.serve.stops import StopText

ALPHABET = "ab c"


def _cut(pieces: list, stops: tuple) -> tuple[str, bool]:
    """The reference: after the first piece that completes a stop string, the text before the
    earliest stop string in the text so far (the stream ends there); else the whole text."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)], True
    return text, False


@given(st.lists(st.text(ALPHABET, max_size=4), max_size=12),
       st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=4))
@example(["a", "b", "c"], ["abc", "b"]).via("a shorter stop completes first")
@example(["xa", "b c"], ["ab"]).via("a stop across pieces")
def test_streamed_stop_strings_cut_as_the_text_so_far_would(pieces, stops):
    stopper, out, stopped = StopText(tuple(stops)), "", False
    for piece in pieces:
        text, stopped = stopper.push(piece)
        out += text
        if stopped:
            break
    if not stopped:
        out += stopper.flush()
    want, found = _cut(pieces, tuple(stops))
    assert stopped == found
    assert out == want


def test_checked_requests():
    ids = ("tiny",)
    ask = parse_ask({"prompt": "x", "stop": "\n", "max_tokens": 5, "seed": 3}, False, ids, 64)
    assert (ask.prompt, ask.stops, ask.max_tokens, ask.params.seed) == ("x", ("\n",), 5, 3)
    chat = parse_ask({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}],
                      "max_completion_tokens": 7, "stream": True,
                      "stream_options": {"include_usage": True}}, True, ids, 64)
    assert chat.messages == ({"role": "user", "content": "ab"},) and chat.max_tokens == 7
    assert chat.include_usage and chat.params.temp == 0.8       # run's defaults
    for body, param in [({"prompt": "x", "top_k": -1}, "top_k"),
                        ({"prompt": "x", "min_p": 1.5}, "min_p"),
                        ({"prompt": "x", "seed": 1.5}, "seed"),
                        ({"prompt": "x", "logprobs": 21}, "logprobs"),
                        ({"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
                        ({"prompt": ["a", "b"]}, "prompt"),
                        ({"prompt": "x", "max_tokens": 65}, "max_tokens")]:
        with pytest.raises(ApiError) as e:
            parse_ask(body, False, ids, 64)
        assert e.value.status == 400 and e.value.param == param
