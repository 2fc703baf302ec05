"""A new user's second list (issue 47), each the command and what must happen: no traceback, no
data loss, no unbounded allocation from any file or option, one clear line and a non-zero exit
for what cannot work."""
from __future__ import annotations

import importlib
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from flashllm.cli import app
from flashllm.errors import SourceError
from flashllm.format.lock import exclusive
from test_chat import tiny  # noqa: F401  (the tiny converted model fixture)

ROOT = Path(__file__).resolve().parent.parent


def _flashllm(*args, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "flashllm", *args], capture_output=True,
                          text=True, timeout=120, env=env, **kw)


def test_a_huge_temperature_samples_without_a_warning(tiny):  # noqa: F811
    r = _flashllm("run", str(tiny[0].path), "-p", "hello", "-n", "3", "--temp", "1e308",
                  "--seed", "1", stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and "Warning" not in r.stderr and "site-packages" not in r.stderr, r.stderr


def test_one_shot_stdout_holds_the_tokens_alone_no_newline_added(tiny):  # noqa: F811
    r = _flashllm("run", str(tiny[0].path), "-p", "hello there", "-n", "3", "--temp", "0",
                  "--no-timings", stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and r.stdout and not r.stdout.endswith("\n"), repr(r.stdout)


def test_a_prompt_with_text_piped_to_stdin_says_stdin_is_not_read(tiny):  # noqa: F811
    r = _flashllm("run", str(tiny[0].path), "-p", "hello", "-n", "2", "--temp", "0",
                  "--no-timings", input="how are you\n")
    assert r.returncode == 0 and "the text piped to stdin is not read" in r.stderr, r.stderr


def test_system_prompt_without_a_chat_is_refused(tiny):  # noqa: F811
    r = CliRunner().invoke(app, ["run", str(tiny[0].path), "-p", "hello", "-sys", "be terse"])
    assert r.exit_code == 1 and "give -i/--chat" in r.output, r.output


def test_a_context_no_machine_holds_is_refused_before_allocating(tiny):  # noqa: F811
    r = CliRunner().invoke(app, ["run", str(tiny[0].path), "-i", "-c", "999999999"], input="")
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and lines[-1].startswith("error: a context of 999999999 tokens needs")
    assert "lower --ctx-size" in lines[-1]


def test_a_context_past_the_trained_one_is_warned(tiny):  # noqa: F811
    r = CliRunner().invoke(app, ["run", str(tiny[0].path), "-i", "-c", "300", "-n", "2"],
                           input="hello\n")
    assert r.exit_code == 0 and "past the 256 the model was trained on" in r.output, r.output


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    for cmd in (["run", str(fifo), "-p", "hi"], ["convert", str(fifo), "-o", str(tmp_path / "o")]):
        r = _flashllm(*cmd, stdin=subprocess.DEVNULL)
        assert r.returncode == 1 and "not a regular file or folder" in r.stderr, r.stderr


def test_a_symlink_loop_is_named_as_one(tmp_path):
    (tmp_path / "a.gguf").symlink_to(tmp_path / "b.gguf")
    (tmp_path / "b.gguf").symlink_to(tmp_path / "a.gguf")
    for cmd in (["run", str(tmp_path / "a.gguf"), "-p", "hi"],
                ["convert", str(tmp_path / "a.gguf"), "-o", str(tmp_path / "o")]):
        r = CliRunner().invoke(app, cmd)
        assert r.exit_code == 1 and "symbolic links" in r.output, r.output


def test_zero_attention_heads_is_one_line(tmp_path, hf_tiny):
    from flashllm.convert.sources import open_source
    folder, _ = hf_tiny("llama")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).symlink_to(f)
    cfg = json.loads((folder / "config.json").read_text())
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 0}))
    with pytest.raises(SourceError, match="num_attention_heads=0 must be a positive integer"):
        open_source(bad)


def test_a_long_message_off_a_terminal_is_one_line(tiny):  # noqa: F811
    long = "/tmp/" + "x" * 150 + "/model"
    r = CliRunner().invoke(app, ["run", long, "-p", "hi"])
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output


def test_ctrl_c_on_a_terminal_starts_its_line_after_the_echoed_c(monkeypatch):
    app_module = importlib.import_module("flashllm.cli.app")
    out = io.StringIO()
    monkeypatch.setattr(app_module, "err", Console(file=out, force_terminal=True))
    assert app_module._interrupted(KeyboardInterrupt()) == 130
    assert out.getvalue().startswith("\ninterrupted")


def test_a_waiter_says_it_waits_and_no_lock_file_is_left(tmp_path):
    lock, said, order = tmp_path / ".m.lock", [], []

    def second():
        with exclusive(lock, said.append, "waiting for the first"):
            order.append("second")

    with exclusive(lock):
        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.5)
        order.append("first")
    t.join(timeout=10)
    assert order == ["first", "second"] and said == ["waiting for the first"]
    assert not lock.exists()


def test_a_damaged_conversion_says_how_to_make_it_anew(tiny, tmp_path):  # noqa: F811
    import shutil
    bad = tmp_path / "m"
    shutil.copytree(tiny[0].path, bad)
    (bad / ".verified").unlink(missing_ok=True)
    with open(bad / "dense.bin", "r+b") as f:              # one byte of the dense weights
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    r = CliRunner().invoke(app, ["run", str(bad), "-p", "hello", "-n", "2"])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and "checksum mismatch" in lines[0], r.output
    assert f"flashllm convert SOURCE -o '{bad}' --force" in lines[0]


def test_a_refused_budget_names_one_minimum(tiny):  # noqa: F811
    """-i -c 10000000 --dram-budget 300MiB named 'give at least 4610 MiB' and 'the least that
    works: 1537 MiB' in one line: the bisection's upper end was never checked, and the
    resident estimate is not what works. Now both say the least budget the planner accepts."""
    import re
    r = CliRunner().invoke(app, ["run", str(tiny[0].path), "-i", "-c", "2000000",
                                 "--dram-budget", "1MiB"], input="")
    line = r.output.strip().splitlines()[-1]
    named = set(re.findall(r"give at least ([0-9]+) MiB|works for this model and context: "
                           r"([0-9]+) MiB", line))
    numbers = {n for pair in named for n in pair if n}
    assert r.exit_code == 1 and len(numbers) == 1, line
