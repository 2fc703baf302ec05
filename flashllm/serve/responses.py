"""OpenAI's response objects built from a job's events: the whole answer (chat.completion /
text_completion) and the streamed chunks. A chat with tools gets its calls as message.tool_calls
(finish_reason "tool_calls") and, streamed, as OpenAI streams them (delta.tool_calls: the call's
index, id, type and function name with empty arguments, then its arguments). Logprobs, when
asked, in OpenAI's shapes (serve/logprobs.py); streamed, a chunk carries those of the tokens
made since the last one.
"""
from __future__ import annotations

import time
import uuid
from typing import Optional

from flashllm.serve.api import Ask
from flashllm.serve.logprobs import chat_logprobs, completion_logprobs
from flashllm.serve.tools import ToolText, new_call_id, openai_calls, split_answer


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(n_prompt: int, n_gen: int, n_cached: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: the prompt's start a stream's KV cache held."""
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen,
            "total_tokens": n_prompt + n_gen, "prompt_tokens_details": {"cached_tokens": n_cached}}


def parses_calls(ask: Ask) -> bool:
    return ask.chat and ask.tools is not None and ask.tools.parse


def shaped_logprobs(ask: Ask, entries: list, offset: int = 0) -> Optional[dict]:
    """The choice's logprobs object of entries (serve/logprobs.py), None when none was asked."""
    if ask.logprobs is None:
        return None
    return chat_logprobs(entries) if ask.chat else completion_logprobs(entries, offset)


def response(ask: Ask, rid: str, model: str, text: str, finish: str, use: dict,
             entries: tuple = ()) -> dict:
    """The whole (not streamed) response object."""
    choice = {"index": 0, "finish_reason": finish, "logprobs": shaped_logprobs(ask, list(entries))}
    if ask.chat:
        message = {"role": "assistant", "content": text}
        if parses_calls(ask):
            message["content"], calls = split_answer(text, ask.tools.names)
            if calls:
                message["tool_calls"] = openai_calls(calls)
                choice["finish_reason"] = "tool_calls" if finish == "stop" else finish
        choice["message"] = message
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if ask.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice], "usage": use}


def chunk(ask: Ask, rid: str, model: str, text: Optional[str], finish: Optional[str],
          first: bool = False, use: Optional[dict] = None, calls: Optional[list] = None,
          logprobs: Optional[dict] = None) -> dict:
    """One streamed chunk: a piece of text (or delta.tool_calls), or (text None) the closing one
    with finish_reason; with use and nothing else, the usage chunk of
    stream_options.include_usage."""
    choices = []
    if use is None or text is not None or finish is not None or calls:
        choice = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
        if ask.chat:
            delta = {} if text is None else {"content": text}
            if calls:
                delta["tool_calls"] = calls
            choice["delta"] = {"role": "assistant", **delta} if first else delta
        else:
            choice["text"] = text or ""
        choices.append(choice)
    out = {"id": rid, "object": "chat.completion.chunk" if ask.chat else "text_completion",
           "created": int(time.time()), "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


class Chunks:
    """A job's events turned into the chunks of its stream: start(), text(piece),
    logprob(entry), done(finish, counts); each returns the chunks to send."""

    def __init__(self, ask: Ask, rid: str, model: str):
        self.ask, self.rid, self.model = ask, rid, model
        self.tools = ToolText(ask.tools.names) if parses_calls(ask) else None
        self.entries: list = []           # logprobs not sent yet
        self.offset = 0                   # characters sent (completions' text_offset)
        self.calls = 0

    def start(self) -> list:
        return [chunk(self.ask, self.rid, self.model, "", None, first=True)] if self.ask.chat \
            else []

    def logprob(self, entry: dict) -> list:
        self.entries.append(entry)
        return []

    def text(self, piece: str) -> list:
        if self.tools is None:
            return [self._content(piece)]
        return self._tool_events(self.tools.push(piece))

    def done(self, finish: str, counts: tuple) -> list:
        out = self._tool_events(self.tools.flush()) if self.tools is not None else []
        if self.calls and finish == "stop":
            finish = "tool_calls"
        out.append(chunk(self.ask, self.rid, self.model, None, finish,
                         logprobs=self._take()))
        if self.ask.include_usage:
            out.append(chunk(self.ask, self.rid, self.model, None, None, use=usage(*counts)))
        return out

    def _take(self) -> Optional[dict]:
        if not self.entries:
            return None
        out = shaped_logprobs(self.ask, self.entries, self.offset)
        self.entries = []
        return out

    def _content(self, text: str) -> dict:
        out = chunk(self.ask, self.rid, self.model, text, None, logprobs=self._take())
        self.offset += len(text)
        return out

    def _tool_events(self, events: list) -> list:
        out = []
        for event in events:
            if event[0] == "content":
                out.append(self._content(event[1]))
                continue
            _, name, args = event
            head = {"index": self.calls, "id": new_call_id(), "type": "function",
                    "function": {"name": name, "arguments": ""}}
            out.append(chunk(self.ask, self.rid, self.model, None, None, calls=[head]))
            out.append(chunk(self.ask, self.rid, self.model, None, None, calls=[
                {"index": self.calls, "function": {"arguments": args}}]))
            self.calls += 1
        return out
