"""A jinja2 sandbox whose renders are bounded in size, work and time.

A chat template comes from a downloaded file, so it is untrusted code: jinja2's sandbox keeps it
from reaching Python's internals, but not from asking for `'a' * 10**10` (tens of GB) or looping
`range(10**5)` inside `range(10**5)` (hours). Renders here are refused, with one ChatError line,
once a value they make would pass MAX_CHARS characters, a number passes MAX_INT, or the render has
run MAX_SECONDS: sizes are checked before each operator, filter or call that could make a large
value, and time by a trace function on the render's own frames.
"""
from __future__ import annotations

import functools
import re
import sys
import time
from typing import Any, Callable

from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_CHARS = 1 << 20        # the longest string or list a template may build: 1 Mi items
MAX_INT = 1 << 20          # the largest count or width a template may pass to a call or filter
MAX_EXPONENT_BITS = 64     # a ** b may make a number of at most this many bits
MAX_SECONDS = 2.0          # a render's time
TRACE_EVERY = 64           # trace events between two clock reads
_WIDE = re.compile(r"[0-9]{%d,}" % (len(str(MAX_INT)) + 1))   # a width or precision past MAX_INT


class TemplateLimit(Exception):
    """A template asked for more than the sandbox gives (raised inside the render)."""


def _size(value: Any) -> int:
    """The items a value holds, a list's strings counted by their characters (0 for anything
    that is not a sized sequence)."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return len(value) + sum(len(v) for v in value if isinstance(v, (str, bytes)))
    return 0


def _check_args(args, kwargs) -> None:
    """Refuse a call whose integer arguments ask for more than MAX_INT (a width, a count, a
    range)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_INT:
            raise TemplateLimit(f"a number too large for a template ({a})")
        if _size(a) > MAX_CHARS:
            raise TemplateLimit(f"a value longer than {MAX_CHARS} characters")


def _check_format(text: str) -> None:
    """Refuse a %- or {}-format string asking for a field wider than MAX_INT (checked before the
    formatting makes it)."""
    if _WIDE.search(text):
        raise TemplateLimit("a format width too large for a template")


def _guarded(fn: Callable) -> Callable:
    """A filter whose arguments are size-checked before it runs, and its result after (jinja's
    pass_context / pass_environment marks are kept by wraps)."""
    @functools.wraps(fn)
    def filter_(*args, **kwargs):
        _check_args(args, kwargs)
        return _check_result(fn(*args, **kwargs))
    return filter_


def _check_result(value: Any) -> Any:
    if _size(value) > MAX_CHARS:
        raise TemplateLimit(f"a value longer than {MAX_CHARS} characters")
    return value


def _product_size(left: Any, right: Any) -> int:
    """The length of left * right when one side is a sequence and the other a count."""
    if isinstance(right, int) and _size(left):
        return _size(left) * max(right, 0)
    if isinstance(left, int) and _size(right):
        return _size(right) * max(left, 0)
    return 0


class _ConcatGenerator(CodeGenerator):
    """jinja's code generator with `a ~ b` joined through environment.bounded_concat (jinja
    compiles it to a plain join that no sandbox hook sees)."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.bounded_concat(")
        super().visit_Concat(node, frame)
        self.write(")")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with every operator, filter and call size-checked."""

    intercepted_binops = frozenset(["*", "**", "+", "%"])
    code_generator_class = _ConcatGenerator

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.filters = {name: _guarded(fn) for name, fn in self.filters.items()}
        self.filters["format"] = _guarded(_format_filter(self.filters["format"]))

    @staticmethod
    def bounded_concat(joined: str) -> str:
        """`a ~ b ~ ...` once joined: its parts are already bounded, so is the join."""
        return _check_result(joined)

    def add_filter(self, name: str, fn: Callable) -> None:
        """Register a filter of ours, size-checked like jinja's own."""
        self.filters[name] = _guarded(fn)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*" and _product_size(left, right) > MAX_CHARS:
            raise TemplateLimit(f"a value longer than {MAX_CHARS} characters")
        if operator == "**" and isinstance(left, int) and isinstance(right, int) \
                and right > 0 and abs(left) > 1 and right * abs(left).bit_length() > MAX_EXPONENT_BITS:
            raise TemplateLimit(f"a number too large for a template ({left} ** {right})")
        if operator == "%" and isinstance(left, str):
            _check_format(left)
        return _check_result(super().call_binop(context, operator, left, right))

    def wrap_str_format(self, value: Any):
        """str.format / format_map, reached as an attribute: its format string checked first."""
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _check_format(value.__self__)
        return wrapped

    def call(self, __context, __obj, *args, **kwargs) -> Any:
        _check_args(args, kwargs)
        return _check_result(super().call(__context, __obj, *args, **kwargs))



def _format_filter(fn: Callable) -> Callable:
    """jinja's `format` filter with its format string checked first."""
    @functools.wraps(fn)
    def format_(value, *args, **kwargs):
        if isinstance(value, str):
            _check_format(value)
        return fn(value, *args, **kwargs)
    return format_


def bounded_render(template, seconds: float = MAX_SECONDS, **variables) -> str:
    """template (a jinja2 Template of a BoundedEnvironment) rendered with a deadline and at most
    MAX_CHARS characters of output: a trace function on the frames it runs raises TemplateLimit
    once `seconds` have passed (read every TRACE_EVERY events). The caller's own trace function
    (a debugger, coverage) is back afterwards."""
    deadline = time.monotonic() + seconds
    events = 0

    def local(frame, event, arg):
        nonlocal events
        events += 1
        if events % TRACE_EVERY == 0 and time.monotonic() > deadline:
            raise TemplateLimit(f"the template ran longer than {seconds:g} s")
        return local

    def start(frame, event, arg):
        return local

    def render() -> str:
        parts, n = [], 0
        for part in template.generate(**variables):
            n += len(part)
            if n > MAX_CHARS:
                raise TemplateLimit(f"the template's output passed {MAX_CHARS} characters")
            parts.append(part)
        return "".join(parts)

    previous = sys.gettrace()
    sys.settrace(start)
    try:
        return render()
    finally:
        sys.settrace(previous)
