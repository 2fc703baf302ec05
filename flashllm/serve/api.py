"""The OpenAI request bodies checked into an Ask (the response objects: serve/responses.py).

Validation follows OpenAI's API: a field of the wrong type or out of range is a 400 naming it
(`param`); unknown fields are ignored (as llama.cpp's server and vLLM do, so clients that send
their own extensions still work); fields we know but cannot honour (n > 1, echo, suffix,
best_of, legacy functions) are a 400. response_format (json_object, json_schema) and a forced
tool_choice are compiled here: a schema that does not compile is a 400. Sampling defaults are
`flashllm run`'s.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from flashllm.generation.sampler import SamplerParams
from flashllm.serve.errors import ApiError
from flashllm.serve.messages import parse_messages
from flashllm.serve.tools import Tools, call_grammar, parse_tools

MAX_STOPS = 4                       # OpenAI's limit on `stop` strings
MAX_LOGPROBS = 20                   # OpenAI's limit on top_logprobs


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
    grammar: Optional[str] = None       # response_format's or a forced tool_choice's, compiled
                                        # (generation/grammar.py)
    tools: Optional[Tools] = None       # chat: the request's tools (serve/tools.py)
    logprobs: Optional[int] = None      # the alternatives a token's logprobs list (0: the
                                        # token's own alone); None: no logprobs


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
    params = _sampling(body)
    limit_key = "max_completion_tokens" if chat and "max_completion_tokens" in body \
        else "max_tokens"
    max_tokens = _integer(body, limit_key, None, 1, max_tokens_cap)
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    usage = stream and bool((options or {}).get("include_usage", False))
    prompt, messages = (None, parse_messages(body.get("messages"))) if chat \
        else (_prompt(body), None)
    tools = parse_tools(body) if chat else None
    grammar = _response_format(body)
    if tools is not None and tools.forced is not None:
        if grammar is not None:
            raise ApiError(400, "response_format and a tool_choice that forces a call cannot "
                           "both constrain the answer", "tool_choice")
        grammar = call_grammar(tools)
    return Ask(chat, prompt, messages, params, max_tokens, _stops(body), stream, usage,
               grammar, tools, _logprobs(body, chat))


def _sampling(body: dict) -> SamplerParams:
    """The sampler of a body: run's defaults, OpenAI's penalties (-2..2) and llama.cpp's
    repeat_penalty / repeat_last_n."""
    return SamplerParams(temp=_number(body, "temperature", 0.8, 0.0, 2.0),
                         top_p=_number(body, "top_p", 0.95, 0.0, 1.0, low_open=True),
                         top_k=_integer(body, "top_k", 40, 0, None),
                         min_p=_number(body, "min_p", 0.05, 0.0, 1.0),
                         seed=_integer(body, "seed", None, None, None),
                         presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
                         frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
                         repeat_penalty=_number(body, "repeat_penalty", 1.0, 0.0, 10.0,
                                                low_open=True),
                         repeat_last_n=_integer(body, "repeat_last_n", 64, -1, None))


def _logprobs(body: dict, chat: bool) -> Optional[int]:
    """How many alternatives each token's logprobs list: chat's logprobs (a boolean) and
    top_logprobs (0..20), completions' logprobs (0..20); None: none asked."""
    if not chat:
        return None if body.get("logprobs") is False else \
            _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    top = _integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if not _flag(body, "logprobs"):
        if top is not None:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return top or 0


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
    if n is not None and (n != 1 or isinstance(n, bool)):
        raise ApiError(400, "only n = 1 is supported", "n")
    for key in ("echo", "functions", "function_call", "suffix", "best_of"):
        value = body.get(key)
        if value not in (None, False) and not (key == "best_of" and value == 1):
            raise ApiError(400, f"{key} is not supported" + (" (use tools)" if key.startswith(
                "function") else ""), key)


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
