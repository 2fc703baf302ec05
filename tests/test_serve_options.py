"""`flashllm serve`'s options refused before it listens: one line, exit 1."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_helpers import build_tiny  # noqa: E402

pytest.importorskip("uvicorn")
from flashllm.cli import app  # noqa: E402


def _serve(args) -> tuple:
    r = CliRunner().invoke(app, ["serve", *args])
    return r.exit_code, r.output.strip().splitlines()


def test_an_empty_host_is_refused(tmp_path):
    code, lines = _serve([str(build_tiny(tmp_path / "m")), "--host", " "])
    assert code == 1 and lines[-1].startswith("error: --host is empty")


def test_a_context_no_machine_holds_names_the_streams(tmp_path):
    """The KV refusal counts every stream's context: it says so, with both options."""
    code, lines = _serve([str(build_tiny(tmp_path / "m")), "-c", "999999999", "--parallel", "4"])
    assert code == 1 and len(lines) == 1, lines
    assert "of KV cache" in lines[0] and "--parallel 4 streams of --ctx-size 999999999" in lines[0]


def test_a_self_draft_without_a_budget_is_refused_as_run_refuses_it(tmp_path):
    """--draft-kind self drafts from what a --dram-budget keeps in DRAM: without one, `serve`
    says so in run's words before it loads anything."""
    code, lines = _serve([str(build_tiny(tmp_path / "m")), "--draft-kind", "self"])
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: --draft-kind self drafts from the part of the model a "
                               "--dram-budget keeps in DRAM"), lines
