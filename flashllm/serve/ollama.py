"""Ollama's API over the same Asks: /api/chat and /api/generate bodies become the OpenAI bodies
serve/api.py checks (so every field gets the same checks and 400s), and a job's events become
Ollama's objects (NDJSON lines, or one object with `stream: false`).

    options: temperature, top_p, top_k, min_p, seed, stop, num_predict (-1 / -2: until the end
    or the context), presence_penalty, frequency_penalty, repeat_penalty, repeat_last_n; others
    (num_ctx, num_thread, mirostat...) are ignored as Ollama ignores what a runner lacks.
    format: "json" (any JSON object) or a JSON schema.
"""
from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Optional

from flashllm.serve.errors import ApiError
from flashllm.serve.tools import ToolText

VERSION = "0.9.0"          # the Ollama API version these routes answer as
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
            "frequency_penalty", "repeat_penalty", "repeat_last_n")


def names_of(model_id: str) -> tuple:
    """The names a request's `model` may give: the served one and (Ollama's default tag) with
    `:latest`."""
    return (model_id,) if ":" in model_id else (model_id, model_id + ":latest")


def check_model(body, names: tuple) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required")
    if model not in names:
        raise ApiError(404, f"model \"{model}\" not found (this server serves \"{names[-1]}\")")


def chat_body(body, names: tuple, cap: int) -> dict:
    """The OpenAI chat body of an /api/chat body; ApiError as Ollama answers (400, 404)."""
    check_model(body, names)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty array")
    for m in messages:
        if isinstance(m, dict) and m.get("images"):
            raise ApiError(400, "images are not supported (this model reads text)")
    out = {"messages": [_message(m) for m in messages], "stream": _stream(body),
           **_options(body, cap), **_logprobs(body, True)}
    if body.get("tools"):
        out["tools"] = body["tools"]
    return out


def _message(m):
    """Ollama's tool message names its function (tool_name) where OpenAI's names the call."""
    if isinstance(m, dict) and m.get("role") == "tool" and "tool_call_id" not in m:
        return {**m, "tool_call_id": str(m.get("tool_name", ""))}
    return m


def _logprobs(body: dict, chat: bool) -> dict:
    """The OpenAI fields of Ollama's logprobs (a boolean) and top_logprobs."""
    if not body.get("logprobs"):
        return {"top_logprobs": body["top_logprobs"]} if "top_logprobs" in body else {}
    top = body.get("top_logprobs")
    return {"logprobs": True, "top_logprobs": top} if chat else {"logprobs": top or 0}


def generate_body(body, names: tuple, cap: int) -> tuple[dict, bool]:
    """(the OpenAI body, chat) of an /api/generate body: its prompt (and system) as a chat's
    user (and system) message, or with `raw` as a completion's prompt."""
    check_model(body, names)
    for key in ("images", "suffix", "context"):
        if body.get(key):
            raise ApiError(400, f"{key} is not supported" + (
                " (send the conversation to /api/chat)" if key == "context" else ""))
    prompt, system = body.get("prompt", ""), body.get("system")
    if not isinstance(prompt, str) or (system is not None and not isinstance(system, str)):
        raise ApiError(400, "prompt and system must be strings")
    out = {"stream": _stream(body), **_options(body, cap)}
    if body.get("raw"):
        return {**out, **_logprobs(body, False), "prompt": prompt}, False
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": prompt}]
    return {**out, **_logprobs(body, True), "messages": messages}, True


def _stream(body: dict) -> bool:
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean")
    return stream


def _options(body: dict, cap: int) -> dict:
    """The OpenAI fields of Ollama's options and format."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "options must be an object")
    out = {k: options[k] for k in SAMPLING if options.get(k) is not None}
    n = options.get("num_predict")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int):
            raise ApiError(400, "num_predict must be an integer")
        if n > 0:
            out["max_tokens"] = min(n, cap)
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise ApiError(400, "format must be \"json\" or a JSON schema")
    return out


def stamp() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class Lines:
    """A job's events as Ollama's objects: text(piece) and done(finish, counts) return the
    objects to send (a stream's lines), whole(pieces, finish, counts) the one object of
    `stream: false`. chat: /api/chat's message objects, else /api/generate's response ones;
    names: the request's functions, whose calls are read out of the answer (message.tool_calls,
    arguments as objects); None: no tools."""

    def __init__(self, model: str, chat: bool, names: Optional[tuple]):
        self.model, self.chat = model, chat
        self.tools = ToolText(names) if names is not None else None
        self.t0 = time.monotonic_ns()
        self.t_first: Optional[int] = None
        self.entries: list = []            # logprobs not sent yet

    def logprob(self, entry: dict) -> list:
        self.entries.append({"token": entry["token"], "logprob": entry["logprob"],
                             "top_logprobs": [{"token": t, "logprob": lp}
                                              for t, _, lp in entry["top"]]})
        return []

    def _base(self, done: bool) -> dict:
        return {"model": self.model, "created_at": stamp(), "done": done}

    def _piece(self, text: str = "", calls: Optional[list] = None) -> dict:
        out = self._base(False)
        if self.entries:
            out["logprobs"], self.entries = self.entries, []
        if not self.chat:
            return {**out, "response": text}
        message = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return {**out, "message": message}

    def text(self, piece: str) -> list:
        if self.t_first is None:
            self.t_first = time.monotonic_ns()
        if self.tools is None:
            return [self._piece(piece)] if piece else []
        return self._events(self.tools.push(piece))

    def _events(self, events: list) -> list:
        out = []
        for e in events:
            if e[0] == "content":
                out.append(self._piece(e[1]))
            else:
                out.append(self._piece("", [_call(e[1], e[2])]))
        return out

    def done(self, finish: str, counts: tuple) -> list:
        out = self._events(self.tools.flush()) if self.tools is not None else []
        last = self._piece("")
        last.update(self._stats(finish, counts))
        return out + [last]

    def whole(self, pieces: list, entries: list, finish: str, counts: tuple,
              first_ns: Optional[int] = None) -> dict:
        """The one object of stream false; first_ns: when the first token was made."""
        self.t_first = first_ns
        for e in entries:
            self.logprob(e)
        lines = [line for p in pieces for line in self.text(p)] + self.done(finish, counts)
        out = lines[-1]
        if entries:
            out["logprobs"] = [e for line in lines for e in line.get("logprobs", [])]
        key = "message" if self.chat else "response"
        if self.chat:
            calls = [c for line in lines for c in line["message"].get("tool_calls", [])]
            out["message"] = {"role": "assistant",
                              "content": "".join(line["message"]["content"] for line in lines)}
            if calls:
                out["message"]["tool_calls"] = calls
        else:
            out[key] = "".join(line["response"] for line in lines)
        return out

    def _stats(self, finish: str, counts: tuple) -> dict:
        n_prompt, n_gen, _ = counts
        now = time.monotonic_ns()
        first = self.t_first or now
        return {"done": True, "done_reason": "length" if finish == "length" else "stop",
                "total_duration": now - self.t0, "load_duration": 0,
                "prompt_eval_count": n_prompt, "prompt_eval_duration": first - self.t0,
                "eval_count": n_gen, "eval_duration": now - first}


def _call(name: str, args_json: str) -> dict:
    return {"function": {"name": name, "arguments": json.loads(args_json)}}


def model_entry(model_id: str, size: int, arch: str) -> dict:
    """/api/tags' (and /api/ps') entry of the served model."""
    name = names_of(model_id)[-1]
    return {"name": name, "model": name, "modified_at": stamp(), "size": size, "digest": "",
            "details": details(arch)}


def details(arch: str) -> dict:
    return {"parent_model": "", "format": "flashllm", "family": arch, "families": [arch],
            "parameter_size": "", "quantization_level": ""}
