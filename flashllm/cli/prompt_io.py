"""Text a user hands `flashllm run`: the prompt (-p, -f, stdin) and chat lines, made valid
UTF-8 (an undecodable byte becomes U+FFFD, with one warning line on stderr)."""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Optional

from flashllm.cli.app import err, fail


def read_prompt(prompt: Optional[str], file: Optional[Path]) -> str:
    """The one-shot prompt: -p TEXT ('-': stdin), -f FILE ('-': stdin), or piped stdin."""
    if prompt is not None and file is not None:
        fail("give the prompt with -p or -f, not both")
    if file is not None and str(file) != "-":
        try:
            return utf8(file.read_bytes(), f"prompt file {file}")
        except OSError as e:
            fail(f"cannot read prompt file {file}: {e.strerror or e}")
    if prompt == "-" or file is not None or (prompt is None and not sys.stdin.isatty()):
        return utf8(sys.stdin.buffer.read(), "the prompt on stdin")
    if prompt is None:
        fail("no prompt: give -p TEXT, -f FILE, or pipe text to stdin")
    if _piped():
        err.print("note: the text piped to stdin is not read: the prompt is -p's (-p - reads "
                  "stdin)", markup=False, soft_wrap=True)
    return utf8(prompt, "the -p prompt")


def _piped() -> bool:
    """Whether stdin is a pipe or a non-empty file (text given that -p would leave unread)."""
    try:
        st = os.fstat(sys.stdin.fileno())
    except (OSError, ValueError, AttributeError):    # no stdin, or a test's in-memory one
        return False
    return stat.S_ISFIFO(st.st_mode) or (stat.S_ISREG(st.st_mode) and st.st_size > 0)


def utf8(raw, what: str) -> str:
    """raw (bytes, or a str whose undecodable bytes Python kept as surrogates: argv, a TTY) as
    UTF-8 text; bytes that are not UTF-8 become U+FFFD, with one warning line on stderr."""
    data = raw.encode("utf-8", "surrogateescape") if isinstance(raw, str) else raw
    text = data.decode("utf-8", "replace")
    bad = text.count("\ufffd") - data.count("\ufffd".encode())
    if bad:
        err.print(f"warning: {what} is not valid UTF-8: {bad} invalid byte sequence(s) replaced "
                  "with U+FFFD", markup=False, soft_wrap=True)
    return text


def read_line(prompt: str) -> str:
    """input() for a non-TTY stdin: no prompt echo (stdout carries answers only)."""
    line = sys.stdin.buffer.readline()
    if not line:
        raise EOFError
    return utf8(line, "this message")


def read_tty(prompt: str) -> str:
    """input() on a terminal, its bytes made valid UTF-8."""
    return utf8(input(prompt), "this message")
