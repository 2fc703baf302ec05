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


def test_progress_at_zero_starts_the_clock_again():
    """perplexity's progress starts when its first pass does: the time spent loading before it
    does not count in the time left."""
    clock, out = _Clock(), io.StringIO()
    show = eta_progress("perplexity, tokens", out, clock)
    clock.t = 100.0                  # loading and tokenizing took 100 s
    show(0, 10)
    clock.t = 103.0
    show(5, 10)
    assert out.getvalue() == "perplexity, tokens: 5/10 (50%), about 3 s left\n"


def test_perplexity_reports_its_tokens_from_before_the_first_pass(tiny):  # noqa: F811
    """progress(0, total) before any pass, then after each layer of each half of each chunk,
    in tokens; the result is the same as without it."""
    from flashllm.generation.perplexity import perplexity
    flash, tok = tiny
    ids = tok.encode("hello there how are you fine thanks " * 8, add_special=False)   # (56,)
    seen = []
    a = perplexity(Model(flash, n_threads=1, n_ctx=16), ids, n_ctx=16)
    b = perplexity(Model(flash, n_threads=1, n_ctx=16), ids, n_ctx=16,
                   progress=lambda done, total: seen.append((done, total)),
                   on_chunk=lambda i, n, ppl: seen.append(("chunk", i)))
    n = flash.config.n_layers
    assert seen[0] == (0, 48) and seen[-1] == ("chunk", 3)
    first = seen[1:seen.index(("chunk", 1))]
    assert len(first) == 2 * n and first[-1] == (16, 48) and first[n - 1] == (8, 48)
    done = [d for d, t in seen if d != "chunk"]
    assert done == sorted(done) and done[-1] == 48
    assert (a.ppl, a.running) == (b.ppl, b.running)


def test_perplexity_says_what_it_measures_before_the_first_chunk(tiny, tmp_path):  # noqa: F811
    from typer.testing import CliRunner
    from flashllm.cli import app
    text = tmp_path / "t.txt"
    text.write_text("hello there how are you fine thanks " * 8)
    r = CliRunner().invoke(app, ["perplexity", str(tiny[0].path), str(text), "-c", "16",
                                 "-t", "1"])
    lines = r.output.splitlines()
    assert r.exit_code == 0, r.output
    assert lines[0] == "perplexity of 3 chunks of 16 tokens (56 tokens in the text)", lines
    assert lines[1].startswith("[1/3] ") and "min left" in lines[1]
