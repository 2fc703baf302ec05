"""The OpenAI request bodies checked into an Ask, and the response objects built from a result.

Validation follows OpenAI's API: a field of the wrong type or out of range is a 400 naming it
(`param`); unknown fields are ignored (as llama.cpp's server and vLLM do, so clients that send
their own extensions still work); fields we know but cannot honour (n > 1, logprobs, echo,
tools, presence/frequency penalties) are a 400. response_format (json_object, json_schema) is
compiled here: a schema that does not compile is a 400. Sampling defaults are `flashllm run`'s.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Optional

from flashllm.generation.sampler import SamplerParams

MAX_STOPS = 4                       # OpenAI's limit on `stop` strings
ROLES = ("system", "user", "assistant")


class ApiError(Exception):
    """An error response: HTTP status and OpenAI's {"error": {...}} body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, \
            code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass(frozen=True)
class Ask:
    """One checked request: a raw prompt (completions) or messages (chat), its sampling, its
    token limit (None: until a stop token or the end of the context), stop strings, streaming."""

    chat: bool
    prompt: Optional[str]
    messages: Optional[tuple]
    params: SamplerParams
    max_tokens: Optional[int]
    stops: tuple
    stream: bool
    include_usage: bool = False
    grammar: Optional[str] = None       # response_format's, compiled (generation/grammar.py)


def parse_ask(body, chat: bool, model_ids: tuple, max_tokens_cap: int) -> Ask:
    """The Ask of a /v1/chat/completions (chat) or /v1/completions body; ApiError when it is
    not an object, names another model, or has a field of the wrong type or range."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", "model")
    if model is not None and model not in model_ids:
        raise ApiError(404, f"The model `{model}` does not exist (this server serves "
                       f"`{model_ids[0]}`)", "model", "model_not_found")
    _refuse_unsupported(body, chat)
    params = SamplerParams(temp=_number(body, "temperature", 0.8, 0.0, 2.0),
                           top_p=_number(body, "top_p", 0.95, 0.0, 1.0, low_open=True),
                           top_k=_integer(body, "top_k", 40, 0, None),
                           min_p=_number(body, "min_p", 0.05, 0.0, 1.0),
                           seed=_integer(body, "seed", None, None, None))
    limit_key = "max_completion_tokens" if chat and "max_completion_tokens" in body \
        else "max_tokens"
    max_tokens = _integer(body, limit_key, None, 1, max_tokens_cap)
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    usage = stream and bool((options or {}).get("include_usage", False))
    prompt, messages = (None, _messages(body)) if chat else (_prompt(body), None)
    return Ask(chat, prompt, messages, params, max_tokens, _stops(body), stream, usage,
               _response_format(body))


def _response_format(body: dict) -> Optional[str]:
    """The compiled grammar of response_format: {"type": "json_object"} (any JSON object) or
    {"type": "json_schema", "json_schema": {"schema": {...}}}; None for none or "text". 400 for
    any other, or a schema that does not compile."""
    from flashllm.generation.grammar import GrammarError, compile_grammar
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise ApiError(400, "response_format.json_schema.schema must be a JSON schema "
                           "(an object)", "response_format")
    else:
        raise ApiError(400, "response_format.type must be one of text, json_object, "
                       "json_schema", "response_format")
    try:
        return compile_grammar("json_schema", json.dumps(schema))
    except GrammarError as e:
        raise ApiError(400, f"response_format: {e}", "response_format") from None


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """400 for the fields we know and cannot honour."""
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise ApiError(400, "only n = 1 is supported", "n")
    for key in ("logprobs", "echo", "tools", "functions", "top_logprobs", "suffix",
                "best_of"):
        value = body.get(key)
        if value not in (None, False, 1) or (key == "best_of" and value not in (None, 1)):
            raise ApiError(400, f"{key} is not supported", key)
    for key in ("presence_penalty", "frequency_penalty"):
        value = body.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ApiError(400, f"{key} must be a number", key)
        if value != 0:
            raise ApiError(400, f"{key} is not supported (only 0)", key)


def _number(body: dict, key: str, default, low: float, high: float,
            low_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"{key} must be a number", key)
    if not (low < value if low_open else low <= value) or value > high:
        raise ApiError(400, f"{key} = {value} is out of range: it must be in "
                       f"{'(' if low_open else '['}{low}, {high}]", key)
    return float(value)


def _integer(body: dict, key: str, default, low: Optional[int], high: Optional[int]):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{key} must be an integer", key)
    if low is not None and value < low:
        raise ApiError(400, f"{key} = {value}: it must be at least {low}", key)
    if high is not None and value > high:
        raise ApiError(400, f"{key} = {value}: it must be at most {high} (the context of a "
                       "stream)", key)
    return value


def _flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{key} must be a boolean", key)
    return value


def _stops(body: dict) -> tuple:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "stop must be a string or an array of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop takes at most {MAX_STOPS} strings", "stop")
    return tuple(s for s in stops if s)


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt must be a string (one prompt per request)", "prompt")
    return prompt


def _messages(body: dict) -> tuple:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] must be an object with a role in "
                           f"{', '.join(ROLES)}", "messages")
        out.append({"role": m["role"], "content": _content(m.get("content"), i)})
    return tuple(out)


def _content(content, i: int) -> str:
    """A message's text: a string, or an array of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{i}].content must be a string or an array of text parts",
                   "messages")


# ---- responses -------------------------------------------------------------------------------

def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(n_prompt: int, n_gen: int, n_cached: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: the prompt's start a stream's KV cache held."""
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen,
            "total_tokens": n_prompt + n_gen, "prompt_tokens_details": {"cached_tokens": n_cached}}


def response(ask: Ask, rid: str, model: str, text: str, finish: str, use: dict) -> dict:
    """The whole (not streamed) response object."""
    choice = {"index": 0, "finish_reason": finish, "logprobs": None}
    if ask.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if ask.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice], "usage": use}


def chunk(ask: Ask, rid: str, model: str, text: Optional[str], finish: Optional[str],
          first: bool = False, use: Optional[dict] = None) -> dict:
    """One streamed chunk: a piece of text, or (text None) the closing one with finish_reason;
    with use and no choice, the usage chunk of stream_options.include_usage."""
    choices = []
    if use is None or text is not None or finish is not None:
        choice = {"index": 0, "finish_reason": finish, "logprobs": None}
        if ask.chat:
            delta = {} if text is None else {"content": text}
            choice["delta"] = {"role": "assistant", **delta} if first else delta
        else:
            choice["text"] = text or ""
        choices.append(choice)
    out = {"id": rid, "object": "chat.completion.chunk" if ask.chat else "text_completion",
           "created": int(time.time()), "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out
