"""make bench's sections as bench.py runs them: which rows --quick and --models choose, the
"GGUFs in DRAM" table's ratios (each figure against llama.cpp's faster policy on it), the MoE
section's rows and commands, a run of some sections keeping the file's header, and a wrong
--sections refused before anything runs."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from scripts.bench import gguf_dram, moe_caps, report
from scripts.bench.flashllm_cli import ROOT, Flashllm
from scripts.bench.harness import Bench

INFO = {"date": "2026-11-29 08:30", "git": "abc1234", "mode": "full", "reps": "3", "load": "1.0"}


def bench(quick: bool = False, models: tuple = ()) -> Bench:
    args = argparse.Namespace(quick=quick, models=list(models), reps=1 if quick else 3,
                              cache=Path("cache"), work=Path("work"), models_dir=None, timeout=1.0)
    return Bench(args, Flashllm(["flashllm"]), {}, INFO, lambda m: None)


def test_quick_and_models_choose_the_rows():
    """--quick: SmolLM2's GGUF row and no MoE fixture (3.6 GiB each); --models names rows of
    either section; a full run has all seven files, both fixtures' default conversions and the
    Q4_0 fixture's `--dtype q4_0`."""
    full = bench()
    assert gguf_dram.names(full) == ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b",
                                     "gemma-3-270m", "qwen2.5-coder-1.5b-q2_k",
                                     "qwen2.5-coder-1.5b-q3_k_m", "olmoe-shape-q4_0"]
    assert moe_caps.plan(full) == {"q4_0": ["native", "q4_0"], "q4_k_m": ["native"]}
    assert gguf_dram.names(bench(quick=True)) == ["smollm2-135m"]
    assert moe_caps.plan(bench(quick=True)) == {}
    named = bench(quick=True, models=("olmoe-shape-q4_0",))
    assert gguf_dram.names(named) == ["olmoe-shape-q4_0"]
    assert moe_caps.plan(named) == {"q4_0": ["native"]}


def cells(line: str) -> list:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_each_gguf_figure_is_set_against_llama_cpps_faster_policy():
    """flashllm 30 tok/s decode, 200 prefill; llama.cpp passive 20 / 250, spinning 40 / 100:
    decode against 40 (0.75), prefill against 250 (0.80). A policy that failed leaves the
    other as the reference; a file that could not be had is one row saying why."""
    fl = {"decode_tps": 30.0, "prefill_tps": 200.0, "cmd": "flashllm run M", "runs": [(200.0, 30.0)]}
    ll = {"passive": {"decode_tps": 20.0, "prefill_tps": 250.0, "cmd": "python -m x --omp-wait-policy passive"},
          "default": {"decode_tps": 40.0, "prefill_tps": 100.0, "cmd": "python -m x"}}
    row = {"name": "smollm2-135m", "weights": "Q4_1", "mib": 93.8, "made": "`flashllm pull smollm2-135m`",
           "conv": "flashllm convert G -o M --dtype native", "n_prompt": 64, "flashllm": fl, "llama.cpp": ll}
    failed = {**row, "name": "gemma-3-270m", "llama.cpp": {**ll, "default": {"error": "failed (exit 1): x"}}}
    missing = {"name": "qwen2.5-coder-1.5b-q2_k", "weights": "Q2_K", "error": "requantize_gguf failed: boom"}
    lines = gguf_dram.table([row, failed, missing])
    assert cells(lines[2]) == ["smollm2-135m", "Q4_1", "94", "30.00", "200.00", "20.00 / 40.00",
                               "250.00 / 100.00", "0.75", "0.80"]
    assert cells(lines[3])[5:] == ["20.00 / –", "250.00 / –", "1.50", "0.80"]
    assert cells(lines[4])[3] == "requantize_gguf failed: boom" and len(cells(lines[4])) == 9
    notes = gguf_dram.notes([row, missing])
    assert len(notes) == 1 and "runs (prefill, decode) (200.0, 30.0)" in notes[0]


def test_rounds_taken_in_turn_merge_into_one_row_of_medians():
    """gguf_dram.measure takes one run of each engine a round: the row is every round's run,
    their median prefill and decode, the first round's command; a failed round is the row."""
    one = lambda a, d: {"cmd": f"run {a}", "runs": [(a, d)], "prefill_tps": a, "decode_tps": d}  # noqa: E731
    row = gguf_dram.merged([one(100.0, 30.0), one(300.0, 10.0), one(200.0, 50.0)])
    assert row["runs"] == [(100.0, 30.0), (300.0, 10.0), (200.0, 50.0)]
    assert (row["prefill_tps"], row["decode_tps"], row["cmd"]) == (200.0, 30.0, "run 100.0")
    failed = {"cmd": "run x", "runs": [], "error": "failed (exit 1): x"}
    assert gguf_dram.merged([one(100.0, 30.0), failed]) is failed


def moe_result(kind: str, dtype: str, cap: str, fl_tps, error: str = "") -> dict:
    summary = {"io_bytes_per_token": 300 * 2**20, "experts_cached_per_token": 40.0,
               "experts_read_per_token": 88.0, "experts_prefetched_per_token": 3.5,
               "prefetch_hit_rate": 0.5, "guess_recall": 0.25} if fl_tps else {}
    return {"gguf": kind, "dtype": dtype, "cap": cap, "cap_bytes": 1000 * 2**20,
            "model": f"build/moe/olmoe-{kind}-{dtype}", "active": 600 * 2**20,
            "llama.cpp": {"decode_tps": 0.5, "peak": 1000 * 2**20, "error": None,
                          "cmd": [sys.executable, "-m", "scripts.bench.llamacpp", "--model", "G"]},
            "flashllm": {"decode_tps": fl_tps, "peak": 990 * 2**20, "summary": summary,
                         "error": error or None, "shown": f"flashllm run build/moe/olmoe-{kind}-{dtype}"}}


def test_the_moe_section_shows_each_run_and_its_command():
    """moe.py's rows: ratio to llama.cpp, bytes read against the routed experts'; a run that
    failed shows the last line of its error in one cell; llama.cpp's command once per cap,
    flashllm's per conversion, each in its cgroup, and each conversion's command."""
    results = [moe_result("q4_0", "native", "1/2", 6.0),
               moe_result("q4_0", "q4_0", "1/2", None, "Traceback\n  ...\nMemoryError: no | room")]
    text = moe_caps.section_text(bench(), results, ("1.0", "2.0"))
    rows = [ln for ln in text.splitlines() if ln.startswith("| Q4_0")]
    assert cells(rows[0])[2:7] == ["0.50", "6.00", "12.0", "1000 / 990", "300 / 600 = 0.50"]
    assert cells(rows[1])[3] == "MemoryError: no / room" and len(cells(rows[1])) == 9
    limit = f"cgroup_run --cold --limit {1000 * 2**20} -- "
    assert text.count(limit + "python -m scripts.bench.llamacpp") == 1
    assert text.count(limit + "flashllm run") == 2
    assert "-o build/moe/olmoe-q4_0-q4_0 --dtype q4_0`" in text
    assert "-o build/moe/olmoe-q4_0-native`" in text and "not in this run: Q4_K_M, default (native) (quick" in text


def test_a_run_of_some_sections_keeps_the_files_header(tmp_path):
    old = tmp_path / "B.md"
    old.write_text("# t\n\nold head\n\n## Dense decode\n\nd\n\n## I/O\n\nio\n")
    text = report.merge(old, None, {"## GGUFs in DRAM": "## GGUFs in DRAM\n\ng\n"})
    assert text.startswith("# t\n\nold head\n\n## Dense decode\n\nd\n")
    assert text.index("## Dense decode") < text.index("## GGUFs in DRAM") < text.index("## I/O")


def test_an_unknown_section_is_refused_before_anything_runs():
    before = (ROOT / "BENCHMARKS.md").read_bytes()
    res = subprocess.run([sys.executable, "-m", "scripts.bench.bench", "--sections", "dense,nope"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 2 and "unknown section nope" in res.stderr.splitlines()[-1]
    assert (ROOT / "BENCHMARKS.md").read_bytes() == before
