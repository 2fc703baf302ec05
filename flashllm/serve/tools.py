"""Tool calls (OpenAI's `tools` / `tool_choice`): the request's tools checked, the prompt rendered
by the model's own chat template with them, the grammar that makes an answer a call ("required"
or a named function), and the answer's calls parsed out of its text.

Calls are read in the Hermes / Qwen format the templates that take tools ask for:
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block a call. ToolText splits
an answer's streamed text into content and calls as it arrives; a block whose JSON does not parse
stays content (nothing is lost). With calls, the whitespace next to them and at the end of the
content is dropped.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Optional

from flashllm.serve.errors import ApiError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CHOICES = ("none", "auto", "required")
NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")   # OpenAI's function names (and a dot / colon)


@dataclass(frozen=True)
class Tools:
    """A request's tools (OpenAI's {"type": "function", "function": {...}} objects), what the
    template is given (render: None when tool_choice is "none"), the call names it may make
    (forced: None for "auto"; the names a grammar makes the answer call) and whether the answer
    is parsed for calls."""

    tools: tuple
    render: Optional[tuple]
    forced: Optional[tuple]
    parse: bool
    single: bool = False           # one call at most (a named function, or
                                   # parallel_tool_calls false)

    @property
    def names(self) -> tuple:
        return tuple(t["function"]["name"] for t in self.tools)


def parse_tools(body: dict) -> Optional[Tools]:
    """The Tools of a chat body (None when it has none); 400 naming `tools` or `tool_choice`
    for a malformed tool, a choice that is none of OpenAI's, or a function it does not list."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "tools must be an array of function tools", "tools")
    checked = tuple(_tool(t, i) for i, t in enumerate(tools))
    names = [t["function"]["name"] for t in checked]
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel
    if not isinstance(parallel, bool):
        raise ApiError(400, "parallel_tool_calls must be a boolean", "parallel_tool_calls")
    choice = "auto" if choice is None else choice
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ApiError(400, f"tool_choice must be one of {', '.join(CHOICES)} or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                           "tool_choice")
        forced = tuple(names) if choice == "required" else None
        return Tools(checked, None if choice == "none" else checked, forced, choice != "none",
                     single=not parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    if name not in names:
        raise ApiError(400, f"tool_choice names no function of tools ({name!r})", "tool_choice")
    return Tools(checked, checked, (name,), True, single=True)


def _tool(tool, i: int) -> dict:
    """One tool checked: {"type": "function", "function": {"name", "description"?,
    "parameters"? (a JSON schema object)}}, kept as given (the template renders it so)."""
    fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" \
        else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
            not NAME.match(fn["name"]):
        raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                       "{\"name\": ...}} with a name of letters, digits, _ or - (at most 64)",
                       "tools")
    if not isinstance(fn.get("parameters", {}), dict):
        raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                       "tools")
    return {"type": "function", "function": fn}


def parameters(tool: dict) -> dict:
    """A tool's parameters schema (absent: an object of no properties, as OpenAI reads it)."""
    return tool["function"].get("parameters", {"type": "object", "properties": {}})


def call_grammar(tools: Tools) -> Optional[str]:
    """llguidance's grammar of an answer that is calls of tools.forced (None: not forced): one
    call of a named function, or one or more of any for "required" (one with
    parallel_tool_calls false), each call's arguments
    valid under its function's parameters schema. 400 naming `tools` when one does not
    compile."""
    if tools.forced is None:
        return None
    from flashllm.generation.grammar import JSON_WHITESPACE, GrammarError, compile_grammar
    calls = [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]}, "arguments": parameters(t)},
        "required": ["name", "arguments"], "additionalProperties": False}
        for t in tools.tools if t["function"]["name"] in tools.forced]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
    more = "" if tools.single else ' ("\\n" call)*'
    lark = (f"start: call{more}\n"
            f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
            f"body: %json {json.dumps(schema)}\n")
    try:
        return compile_grammar("lark", lark)
    except GrammarError as e:
        raise ApiError(400, f"tools: a function's parameters do not compile: {e}",
                       "tools") from None


def render(template, messages: list, tools: Optional[Tools], model: str) -> str:
    """The prompt of a chat: the template rendered with the tools (when the request has them and
    tool_choice is not "none"); 400 naming the model when its template ignores them (what it
    renders with them is what it renders without)."""
    if tools is None or tools.render is None:
        return template.render(messages, add_generation_prompt=True)
    text = template.render(messages, add_generation_prompt=True, tools=list(tools.render))
    if text == template.render(messages, add_generation_prompt=True):
        raise ApiError(400, f"the chat template of `{model}` does not take tools (it renders "
                       "the same prompt with and without them): this model cannot be given "
                       "tools", "tools")
    return text


# ---- the answer -------------------------------------------------------------------------------

def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def read_call(block: str) -> Optional[tuple]:
    """(name, arguments as JSON text) of a call block's JSON, or None when it is not a call."""
    try:
        return _call_of(json.loads(block))
    except ValueError:
        return None


def _call_of(obj) -> Optional[tuple]:
    """(name, arguments JSON text) of {"name", "arguments" (an object or its JSON text)}; None
    for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def bare_calls(text: str, names: tuple) -> Optional[list]:
    """The calls of an answer that is nothing but JSON call objects naming functions of names
    (a small model may leave out the <tool_call> tags); None when it is anything else."""
    decoder, text, at, calls = json.JSONDecoder(), text.strip(), 0, []
    while at < len(text):
        try:
            obj, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = _call_of(obj)
        if call is None or call[0] not in names:
            return None
        calls.append(call)
        while at < len(text) and text[at].isspace():
            at += 1
    return calls or None


class ToolText:
    """push(piece) / flush() -> events in order: ("content", text) or ("call", name,
    arguments_json). Text that could begin a call block is held until it does or cannot. With
    the request's function names, an answer that begins with "{" is held to its end: when it is
    nothing but call objects naming those functions (bare_calls), they are its calls."""

    def __init__(self, names: tuple = ()):
        self.pending = ""         # text not yet told apart
        self.inside = False       # pending is a call block's body
        self.space = ""           # trailing whitespace of the content, held
        self.after_call = False
        self.calls = 0
        self.names = names
        self.bare: Optional[bool] = None if names else False   # may be bare JSON calls
        self.held = ""            # the answer so far while bare is not False

    def push(self, piece: str) -> list:
        if self.bare is not False:
            self.held += piece
            head = self.held.lstrip()
            if not head or head[0] == "{":
                self.bare = True if head else None
                return []
            self.bare, piece, self.held = False, self.held, ""
        return self._push(piece)

    def flush(self) -> list:
        if self.bare is not False:
            calls = bare_calls(self.held, self.names) if self.held.strip() else None
            if calls:
                self.calls += len(calls)
                self.held = ""
                return [("call", *c) for c in calls]
            self.bare, text, self.held = False, self.held, ""
            return self._push(text) + self._flush()
        return self._flush()

    def _push(self, piece: str) -> list:
        self.pending += piece
        out = []
        while True:
            mark = CLOSE if self.inside else OPEN
            at = self.pending.find(mark)
            if at < 0:
                break
            before, self.pending = self.pending[:at], self.pending[at + len(mark):]
            if self.inside:
                self._block(before, out, closed=True)
            else:
                self._content(before, out)
            self.inside = not self.inside
        if not self.inside:
            keep = _held(self.pending, OPEN)
            self._content(self.pending[:len(self.pending) - keep], out)
            self.pending = self.pending[len(self.pending) - keep:]
        return out

    def _flush(self) -> list:
        out = []
        if self.inside:
            self._block(self.pending, out, closed=False)
        else:
            self._content(self.pending, out)
        self.pending, self.inside = "", False
        if self.space and not self.calls:
            out.append(("content", self.space))
        self.space = ""
        return out

    def _block(self, body: str, out: list, closed: bool) -> None:
        call = read_call(body)
        if call is None:
            self._content(OPEN + body + (CLOSE if closed else ""), out)
            return
        self.space, self.after_call = "", True
        self.calls += 1
        out.append(("call", *call))

    def _content(self, text: str, out: list) -> None:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        text = self.space + text
        body = text.rstrip()
        self.space = text[len(body):]
        if body:
            out.append(("content", body))


def _held(text: str, mark: str) -> int:
    """How many trailing characters of text could begin mark."""
    for n in range(min(len(mark) - 1, len(text)), 0, -1):
        if mark.startswith(text[-n:]):
            return n
    return 0


def split_answer(text: str, names: tuple = ()) -> tuple:
    """(content or None, [(name, arguments_json)]) of a whole answer (names: as ToolText's)."""
    stream = ToolText(names)
    events = stream.push(text) + stream.flush()
    content = "".join(e[1] for e in events if e[0] == "content")
    calls = [e[1:] for e in events if e[0] == "call"]
    return (content or None) if calls else content, calls


def openai_calls(calls: list) -> list:
    """OpenAI's message.tool_calls of [(name, arguments_json)]."""
    return [{"id": new_call_id(), "type": "function",
             "function": {"name": name, "arguments": args}} for name, args in calls]
