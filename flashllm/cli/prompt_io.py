"""Text a user hands `flashllm run`: the prompt (-p, -f, stdin) and chat lines, made valid
UTF-8 (an undecodable byte becomes U+FFFD, with one warning line on stderr)."""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Optional

from flashllm.cli.app import err, fail
from flashllm.limits import read_capped

BYTES_PER_TOKEN = 256        # more than any vocabulary's longest token
MAX_TEXT_BYTES = 64 << 20    # a prompt or chat message, whatever the context


def read_prompt(prompt: Optional[str], file: Optional[Path], ctx_size: int) -> str:
    """The one-shot prompt: -p TEXT ('-': stdin), -f FILE ('-': stdin), or piped stdin; a file
    or stdin is read up to what --ctx-size tokens could hold (text_limit), not to its end."""
    if prompt is not None and file is not None:
        fail("give the prompt with -p or -f, not both")
    limit = text_limit(ctx_size)
    if file is not None and str(file) != "-":
        try:
            return utf8(_capped(file, limit, f"prompt file {file}", ctx_size),
                        f"prompt file {file}")
        except OSError as e:
            fail(f"cannot read prompt file {file}: {e.strerror or e}")
    if prompt == "-" or file is not None or (prompt is None and not sys.stdin.isatty()):
        return utf8(_capped(sys.stdin.buffer, limit, "the prompt on stdin", ctx_size),
                    "the prompt on stdin")
    if prompt is None:
        fail("no prompt: give -p TEXT, -f FILE, or pipe text to stdin")
    if _piped():
        err.print("note: the text piped to stdin is not read: the prompt is -p's (-p - reads "
                  "stdin)", markup=False, soft_wrap=True)
    return utf8(prompt, "the -p prompt")


def text_limit(n_ctx: int) -> int:
    """The most bytes of text that n_ctx tokens could hold: BYTES_PER_TOKEN each (no
    vocabulary's token is longer), at most MAX_TEXT_BYTES."""
    return min(n_ctx * BYTES_PER_TOKEN, MAX_TEXT_BYTES)


def _capped(source, limit: int, what: str, n_ctx: int) -> bytes:
    """source's bytes (a path or a binary stream), refused past limit."""
    data = read_capped(source, limit)
    if data is None:
        fail(f"{what} is more than {limit} bytes: it cannot fit a context of {n_ctx} tokens "
             "(raise --ctx-size, or give less text)")
    return data


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


def line_reader(n_ctx: int):
    """read(prompt) for a chat on a non-TTY stdin, as input() without the prompt's echo (stdout
    carries answers only): a line of at most what n_ctx tokens could hold (text_limit)."""
    limit = text_limit(n_ctx)

    def read(prompt: str) -> str:
        line = sys.stdin.buffer.readline(limit + 1)
        if not line:
            raise EOFError
        if len(line) > limit:
            fail(f"a message of more than {limit} bytes cannot fit the context of {n_ctx} tokens")
        return utf8(line, "this message")
    return read


def read_tty(prompt: str) -> str:
    """input() on a terminal, its bytes made valid UTF-8."""
    return utf8(input(prompt), "this message")
