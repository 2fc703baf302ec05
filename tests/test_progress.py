"""Long work shows its progress on stderr (issue 47: a 4,000-token prompt prefilled for 71 s
with no sign of life): nothing for short work, a rewritten line on a terminal, a line a quarter
off one; prefill reports each layer of the real forward pass."""
from __future__ import annotations

import io

import numpy as np

from flashllm.cli.progress import QUIET_SECONDS, eta_progress
from flashllm.generation.generate import prefill
from flashllm.runtime.model import Model
from test_chat import tiny  # noqa: F401  (the tiny converted model fixture)


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_short_work_shows_nothing_and_long_work_a_line_a_quarter():
    clock, out = _Clock(), io.StringIO()
    show = eta_progress("prefill of 4000 tokens", out, clock)
    show(1, 28)
    assert out.getvalue() == ""
    for done in range(2, 29):
        clock.t = QUIET_SECONDS + done
        show(done, 28)
    lines = out.getvalue().splitlines()
    assert 3 <= len(lines) <= 4 and lines[0].startswith("prefill of 4000 tokens: 2/28 (7%)"), lines
    assert "s left" in lines[-1]


def test_a_terminal_gets_one_line_rewritten_then_cleared():
    clock, out = _Clock(), _Tty()
    show = eta_progress("prefill", out, clock)
    clock.t = 10.0
    show(14, 28)
    assert out.getvalue() == "\r\033[Kprefill: 14/28 (50%), about 10 s left"
    show(28, 28)
    assert out.getvalue().endswith("\r\033[K") and "\n" not in out.getvalue()


def test_prefill_reports_every_layer_and_the_same_logits(tiny):  # noqa: F811
    flash, tok = tiny
    ids = tok.encode("hello there how are you", add_special=False)
    seen = []
    a = prefill(Model(flash, n_threads=1, n_ctx=64), ids)                              # (vocab,)
    b = prefill(Model(flash, n_threads=1, n_ctx=64), ids, progress=lambda i, n: seen.append((i, n)))
    n = flash.config.n_layers
    assert seen == [(i, n) for i in range(1, n + 1)]
    np.testing.assert_array_equal(a, b)
