"""--dram-budget: parsing, the resident-byte plan, and the one-line refusals through the CLI."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from flashllm import budget
from flashllm.budget import BudgetError, parse_budget, plan_budget, read_manifest
from flashllm.cli import app
from test_chat import tiny  # noqa: F401  (the tiny converted model fixture)

MiB = 1 << 20


@pytest.mark.parametrize("text, want", [("1.5GiB", 3 << 29), ("560MiB", 560 * MiB),
                                        ("4096", 4096), ("50%", 500), ("12.5%", 125)])
def test_sizes_and_percentages_of_the_model(text, want):
    assert parse_budget(text, 1000) == want


@pytest.mark.parametrize("text, message", [
    ("lots", "--dram-budget 'lots' is not a size (e.g. 1.5GiB, 560MiB) or a percentage of the "
             "model (e.g. 50%)"),
    ("150%", "--dram-budget '150%': a percentage must be in (0, 100]"),
    ("0%", "--dram-budget '0%': a percentage must be in (0, 100]"),
])
def test_unreadable_budgets_are_named(text, message):
    with pytest.raises(BudgetError) as e:
        parse_budget(text, 1000)
    assert str(e.value) == message


def test_the_caches_get_what_the_resident_bytes_leave(tiny):  # noqa: F811
    man = read_manifest(tiny[0].path)
    f, c = man["ffn"], man["config"]
    kv = 2 * c["n_layers"] * 64 * c["n_kv_heads"] * c["head_dim"] * 4
    fixed = (man["dense"]["nbytes"] + kv + 32 * man["tokenizer"]["nbytes"] + 3 * MiB
             + 8 * MiB + 16 * c["vocab_size"] + f["n_ff"] * f["stride"] + 4 * f["n_ff"] * f["n_layers"])
    rows = 10
    plan = plan_budget(man, str(fixed + rows * f["n_layers"] * (f["stride"] + 12)), 64, 3 * MiB)
    assert (plan.capacity, plan.n_pinned) == (rows, 0)        # no hot-first order: no pins
    assert plan.total <= plan.budget
    with pytest.raises(BudgetError, match="is below the"):
        plan_budget(man, str(fixed - 1), 64, 3 * MiB)


def run(model, *args, rss=100 * MiB, monkeypatch=None):
    monkeypatch.setattr(budget, "process_rss", lambda: rss)
    return CliRunner().invoke(app, ["run", str(model), "-p", "hello there", "-n", "3", "--temp", "0",
                                    *args])


def test_refusals_through_the_cli(tiny, monkeypatch):  # noqa: F811
    model = tiny[0].path
    r = run(model, "--dram-budget", "50MiB", monkeypatch=monkeypatch)
    assert r.exit_code == 1
    assert r.output.strip() == (
        "error: --dram-budget 50MiB (50 MiB) is below the 113 MiB that must stay resident (dense "
        "weights 1 MiB, KV cache 1 MiB, tokenizer 1 MiB, process 100 MiB, buffers 13 MiB); give at "
        "least 113 MiB, or lower --ctx-size")
    r = run(model, "--dram-budget", "10%", monkeypatch=monkeypatch)
    assert r.exit_code == 1 and r.output.startswith("error: --dram-budget 10% (0 MiB) cannot hold ")
    assert "of dense weights (embeddings, attention, norms) that stay in DRAM; streaming them from " \
           "flash is not implemented yet: give at least 113 MiB" in r.output
    r = run(model, "--dense", "--naive", monkeypatch=monkeypatch)
    assert r.exit_code == 1 and r.output.strip() == "error: give --dense or --naive, not both"
    r = run(model, "--dense", "--dram-budget", "113MiB", monkeypatch=monkeypatch)
    assert r.exit_code == 1 and r.output.strip() == (
        "error: --dense needs 114 MiB (every FFN bundle in DRAM), --dram-budget 113MiB gives "
        "113 MiB: drop --dense to stream the FFN from flash")


@pytest.mark.parametrize("args", [["--dram-budget", "120MiB"], ["--naive"]])
def test_flash_runs_give_the_dense_tokens_and_a_stats_table(tiny, monkeypatch, args):  # noqa: F811
    model = tiny[0].path
    dense = run(model, "--no-timings", monkeypatch=monkeypatch)
    flash = run(model, "--no-timings", "--stats", *args, monkeypatch=monkeypatch)
    assert dense.exit_code == 0 and flash.exit_code == 0, flash.output
    assert flash.stdout.splitlines()[0] == dense.stdout.splitlines()[0]
    assert "tok    kind  MB read" in flash.output and " prefill " in flash.output


def test_stats_with_json_joins_the_timings_object(tiny, monkeypatch):  # noqa: F811
    import json
    r = run(tiny[0].path, "--dram-budget", "120MiB", "--stats", "--json", monkeypatch=monkeypatch)
    assert r.exit_code == 0, r.output
    data = json.loads(r.stderr.strip().splitlines()[-1])
    assert data["n_decode"] == len(data["flash"]["tokens"]) - 1       # + the prefill record
    summary = data["flash"]["summary"]
    assert summary["decode_tokens"] == data["n_decode"] and 0 <= summary["hit_rate"] <= 1
    assert "tok    kind" not in r.stderr                                # no text table with --json
