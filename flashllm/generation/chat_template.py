"""Chat templates: a model's Jinja template rendered in a sandbox, as transformers renders it.

Templates come from the converted model (tokenizer_config.json's chat_template or GGUF
tokenizer.chat_template) or a file the user names. They are untrusted code, so they run in
jinja2's ImmutableSandboxedEnvironment, bounded in size and time (template_sandbox.py), with the
globals transformers provides (raise_exception, strftime_now, a JSON tojson filter) and nothing
else.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Sequence

import jinja2

from flashllm.errors import FlashError
from flashllm.generation.template_sandbox import BoundedEnvironment, TemplateLimit, bounded_render
from flashllm.model.archs import REGISTRY

# llama.cpp's fallback when a model carries no template (llm_chat_template CHATML).
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
ROLES = ("system", "user", "assistant", "tool")


class ChatError(FlashError):
    """A chat template that cannot be compiled or rendered, or a message that cannot fit."""


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled template; render(messages) -> the prompt text the model continues."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", name: str = "template"):
        if not isinstance(source, str) or not source.strip():
            raise ChatError(f"chat {name} is empty")
        env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                 extensions=["jinja2.ext.loopcontrols"])
        env.add_filter("tojson", _tojson)
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatError(f"chat {name} does not compile: {e}") from None
        self.source = source
        self.name = name
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True,
               tools: Sequence[dict] | None = None) -> str:
        """The conversation as text; ChatError when the template fails or refuses it. tools:
        OpenAI's function tools ({"type": "function", "function": {...}}), given to the template
        as transformers' apply_chat_template gives them (None: no `tools` variable)."""
        for m in messages:
            if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ChatError(f"bad chat message {m!r}: needs a role in {ROLES} and text content")
        extra = {} if tools is None else {"tools": [dict(t) for t in tools]}
        try:
            text = bounded_render(self._template, messages=[dict(m) for m in messages],
                                  add_generation_prompt=add_generation_prompt,
                                  bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except TemplateLimit as e:
            raise ChatError(f"chat {self.name} refused: {e}") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, OverflowError,
                AttributeError, ZeroDivisionError, RecursionError, MemoryError) as e:
            raise ChatError(f"chat {self.name} failed to render the conversation: "
                            f"{type(e).__name__}: {e}") from None
        if not isinstance(text, str):
            raise ChatError(f"chat {self.name} rendered no text")
        return text


def load_template(flash_template: str | None, override: str | None, bos_token: str,
                  eos_token: str, arch: str = "") -> tuple[ChatTemplate, str]:
    """The template to use and where it came from: override text, the model's, its family's
    turn markers (the Arch's chat_turns, arch: ModelConfig.arch), else ChatML (llama.cpp's
    fallback)."""
    if override is not None:
        return ChatTemplate(override, bos_token, eos_token, "template file"), "--chat-template"
    if flash_template:
        return ChatTemplate(flash_template, bos_token, eos_token, "template of the model"), "model"
    turns = REGISTRY[arch].chat_turns if arch in REGISTRY else None
    if turns is not None:
        family, source = turns
        return (ChatTemplate(source, bos_token, eos_token, f"template ({family} turns)"),
                f"{family} turns (the model carries no template)")
    return ChatTemplate(CHATML, bos_token, eos_token, "template (ChatML fallback)"), "ChatML fallback"
