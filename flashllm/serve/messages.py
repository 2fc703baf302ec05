"""A chat request's messages checked into what a chat template renders: system (OpenAI's
"developer" is a system message), user, assistant (its content may be null when it has
tool_calls) and tool (the answer of a call: tool_call_id). Content is a string or an array of
text parts. An assistant's tool_calls reach the template as transformers gives them, each call's
arguments a JSON object (a string that does not parse stays a string)."""
from __future__ import annotations

import json

from flashllm.serve.errors import ApiError

ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(messages) -> tuple:
    """The checked messages ({"role", "content", ...} dicts); 400 naming `messages`."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty array", "messages")
    return tuple(_message(m, i) for i, m in enumerate(messages))


def _message(m, i: int) -> dict:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise ApiError(400, f"messages[{i}] must be an object with a role in "
                       f"{', '.join(ROLES)}", "messages")
    role = "system" if m["role"] == "developer" else m["role"]
    calls = m.get("tool_calls") if role == "assistant" else None
    if calls == []:
        calls = None
    content = m.get("content")
    if content is None and calls is not None:
        content = ""
    out = {"role": role, "content": _content(content, i)}
    if calls is not None:
        out["tool_calls"] = _calls(calls, i)
    if role == "tool":
        cid = m.get("tool_call_id")
        if not isinstance(cid, str):
            raise ApiError(400, f"messages[{i}] (a tool message) needs a tool_call_id string",
                           "messages")
        out["tool_call_id"] = cid
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out


def _content(content, i: int) -> str:
    """A message's text: a string, or an array of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{i}].content must be a string or an array of text parts",
                   "messages")


def _calls(calls, i: int) -> list:
    """An assistant's tool_calls: [{"id", "type": "function", "function": {"name",
    "arguments"}}], arguments a JSON string (OpenAI's) or an object (Ollama's)."""
    if not isinstance(calls, list):
        raise ApiError(400, f"messages[{i}].tool_calls must be an array", "messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"messages[{i}].tool_calls[{j}] must have a function with a "
                           "name", "messages")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        out.append({"id": call.get("id") if isinstance(call.get("id"), str) else f"call_{j}",
                    "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out
