"""A run plans each candidate once (runtime/plan.choose_plan): the plain plan, the plan with a
self draft's DRAM, the plan with the predictor resident — each plan_budget call is one of them,
none is made twice, all for the run's own context; the bisection for the least budget runs only
when the plan is refused. Counted on `run` through the CLI (a tiny converted model) and on the
1.5B's manifest with a predictor."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from flashllm.cli import app
from flashllm.format.manifest import parse_manifest, read_manifest
from flashllm.runtime import budget, plan as planning
from flashllm.runtime.budget import parse_budget
from flashllm.runtime.plan import AUTO_ROWS, FlashOptions, choose_plan
from flashllm.runtime.resident import head_rows_bytes
from test_budget import MiB, Q15, q15_with_predictor
from test_chat import tiny  # noqa: F401  (the tiny converted model fixture)


def counting(monkeypatch) -> list[tuple[str, int]]:
    """The candidates plan_budget is called for, as (kind, n_ctx): "plain", "draft",
    "predictor" (a predictor's plan may hold a draft's DRAM too)."""
    calls = []
    real = budget.plan_budget

    def counted(man, given, n_ctx, process, **kw):
        kind = "predictor" if kw.get("predictor") else "draft" if kw.get("draft") else "plain"
        calls.append((kind, n_ctx))
        return real(man, given, n_ctx, process, **kw)
    monkeypatch.setattr(planning, "plan_budget", counted)
    return calls


def run(model, *args, monkeypatch):
    monkeypatch.setattr(budget, "process_rss", lambda: 100 * MiB)
    return CliRunner().invoke(app, ["run", str(model), "-p", "hello there", "-n", "3",
                                    "--temp", "0", "--no-timings", *args])


@pytest.mark.parametrize("extra, kinds", [
    ([], ["plain"]),                                          # the caches hold the whole FFN
    (["--draft", "2", "--draft-kind", "self"], ["plain"]),   # nor holds it the head: no DRAM
    (["--draft", "2"], ["plain"]),                            # lookup: no DRAM of its own
])
def test_a_run_under_a_budget_plans_each_candidate_once(tiny, monkeypatch, extra, kinds):  # noqa: F811
    calls = counting(monkeypatch)
    r = run(tiny[0].path, "--dram-budget", "300MiB", *extra, monkeypatch=monkeypatch)
    assert r.exit_code == 0, r.output
    n_ctx = len(tiny[1].encode("hello there", add_special=True)) + 3    # the prompt + -n
    assert calls == [(k, n_ctx) for k in kinds]


def test_the_least_budget_is_sought_only_when_refused(tiny, monkeypatch):  # noqa: F811
    calls = counting(monkeypatch)
    r = run(tiny[0].path, "--dram-budget", "110MiB", monkeypatch=monkeypatch)
    assert r.exit_code == 1 and "the least --dram-budget that works" in r.output
    assert calls[0][0] == "plain" and len(calls) > 10       # then the bisection
    calls.clear()
    assert run(tiny[0].path, "--dram-budget", "119MiB", monkeypatch=monkeypatch).exit_code == 0
    assert [k for k, _ in calls] == ["plain"]


def test_no_plan_without_a_budget(tiny, monkeypatch):  # noqa: F811
    calls = counting(monkeypatch)
    assert run(tiny[0].path, monkeypatch=monkeypatch).exit_code == 0
    assert calls == []


@pytest.mark.parametrize("nbytes, load, auto_rows, kinds, predictor", [
    (20 * MiB, 0.3, AUTO_ROWS, ["plain", "predictor"], True),     # taken: no default draft
    (434 * MiB, 0.5, 0, ["plain", "predictor"], False),
    (434 * MiB, 0.5, AUTO_ROWS, ["plain", "predictor", "draft"], False),
])
def test_choose_plan_builds_each_candidate_once(tmp_path, monkeypatch, nbytes, load, auto_rows,
                                                kinds, predictor):
    """The 1.5B at 560 MiB: the plain plan, the predictor's (taken when cheap), and where no
    predictor is taken and the plain plan streams part of the FFN with all attention resident,
    the default self draft's."""
    man = read_manifest(q15_with_predictor(tmp_path, nbytes, load))
    calls = counting(monkeypatch)
    choice = choose_plan(man, FlashOptions(parse_budget("560MiB")), 512, 40 * MiB,
                         auto_rows=auto_rows)
    assert calls == [(k, 512) for k in kinds]
    assert choice.plan.predictor == predictor
    assert choice.auto_drafted == ("draft" in kinds) and choice.options.draft_rows == (
        AUTO_ROWS if "draft" in kinds else 0)


@pytest.mark.parametrize("rows", [AUTO_ROWS, 5000])
def test_asked_draft_rows_are_one_more_candidate(monkeypatch, rows):
    """--draft-kind self on the 1.5B (no predictor) at 560 MiB, its head streamed: the plain
    plan sizes the draft's rows, the draft's plan holds them."""
    man = parse_manifest(json.loads(Q15.read_text()), Q15)
    calls = counting(monkeypatch)
    plan = choose_plan(man, FlashOptions(parse_budget("560MiB"), draft_rows=rows), 512,
                       40 * MiB).plan
    assert calls == [("plain", 512), ("draft", 512)]
    assert plan.draft_rows == (rows if rows != AUTO_ROWS else plan.draft_rows) > 0
    assert plan.resident["draft"] >= head_rows_bytes(man, plan.draft_rows, 512)


def test_a_refused_draft_names_the_least_budget_that_holds_it(monkeypatch):
    """Asked draft rows that do not fit where the plain plan does: refused naming the least
    budget that holds them (more than the plain plan's least), found by bisection only then."""
    man = parse_manifest(json.loads(Q15.read_text()), Q15)
    least = lambda e: int(str(e.value).rsplit(": ", 1)[1].split()[0])     # noqa: E731
    opts = lambda mib, rows: FlashOptions(parse_budget(f"{mib}MiB"), draft_rows=rows)  # noqa: E731
    with pytest.raises(budget.BudgetError, match="least --dram-budget") as e:
        choose_plan(man, opts(150, 0), 512, 40 * MiB)
    plain = least(e)
    calls = counting(monkeypatch)
    with pytest.raises(budget.BudgetError, match="least --dram-budget") as e:
        choose_plan(man, opts(plain, 150_000), 512, 40 * MiB)
    assert least(e) > plain
    assert calls[:2] == [("plain", 512), ("draft", 512)] and len(calls) > 10
    calls.clear()
    assert choose_plan(man, opts(least(e), 150_000), 512, 40 * MiB).plan.draft_rows == 150_000
    assert calls == [("plain", 512), ("draft", 512)]


def test_a_servers_plan_holds_every_streams_self_draft():
    """serve's 4 streams of 256 positions on the 1.5B at 560 MiB (--draft-kind self): the
    draft's DRAM is one table of head rows with every stream's context (the streams share it:
    runtime/resident.stream_residents) and a ColdCarry per stream, counted from the manifest
    (n_layers x 8 rows x d_model f32 each)."""
    man = parse_manifest(json.loads(Q15.read_text()), Q15)
    cfg = man["config"]
    carry = cfg["n_layers"] * 8 * cfg["d_model"] * 4
    opts = FlashOptions(parse_budget("560MiB"), draft_rows=5000)
    one = choose_plan(man, opts, 256, 40 * MiB).plan
    four = choose_plan(man, opts, 4 * 256, 40 * MiB, streams=4).plan
    assert carry > 0 and one.cache_fraction > 0.4          # the caches hold enough to lend
    assert one.resident["draft"] == head_rows_bytes(man, 5000, 256) + carry
    assert four.resident["draft"] == head_rows_bytes(man, 5000, 4 * 256) + 4 * carry
