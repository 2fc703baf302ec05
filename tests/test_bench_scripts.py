"""The benchmark harness: the cgroup-v1 cap runner against the kernel's own accounting, and the
parsers of `flashllm run`'s timings and --stats table against hand-written llama.cpp-style text,
the read probe's idle-priority spinners."""
from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

from scripts.bench import cgroup_run, flashllm_cli, report, stats
from flashllm.runtime.budget import PROCESS_STEP

MiB = 1 << 20
needs_cgroup = pytest.mark.skipif(cgroup_run.unavailable_reason() is not None,
                                  reason=str(cgroup_run.unavailable_reason()))

TIMINGS = """\
   sampling time =       1.51 ms /    16 runs   (    0.09 ms per token, 10567.68 tokens per second)
prompt eval time =     640.00 ms /    64 tokens (   10.00 ms per token,   100.00 tokens per second)
       eval time =     300.00 ms /    15 runs   (   20.00 ms per token,    50.00 tokens per second)
"""
STATS = """\
flash FFN (sparse): DRAM budget 170 MiB: dense weights 30 MiB; neuron caches 16 MiB
 tok    kind  MB read  reads  avg KiB  GiB/s  prof  hit%   io ms  mm ms  comp ms pred ms recall
   0 prefill    45.00    180    250.0   1.00  2.00   0.0   40.00   0.00   534.86    0.00      -
   1  decode    31.00    150    200.0   0.60  2.00  30.0   50.00   4.00    28.00    0.04   0.91
mean  decode    31.06    154    206.1   0.64  2.02  29.0   50.19   4.27    28.69    0.04   0.90
"""


def test_parse_size():
    assert cgroup_run.parse_size("560MiB") == 560 * MiB
    assert cgroup_run.parse_size("1.5GiB") == 3 * (1 << 29)
    assert cgroup_run.parse_size("4096") == 4096
    with pytest.raises(ValueError):
        cgroup_run.parse_size("lots")


def test_parse_run_timings():
    d = flashllm_cli.parse_run(TIMINGS)
    assert (d["n_prompt"], d["n_decode"]) == (64, 15)
    assert d["prefill_tps"] == pytest.approx(100.0)
    assert d["decode_tps"] == pytest.approx(50.0)
    assert flashllm_cli.parse_run("error: no such model") is None


def test_parse_run_prefers_json():
    d = flashllm_cli.parse_run(TIMINGS + '{"n_prompt": 64, "prefill_s": 2.0, "n_decode": 10, "decode_s": 4.0}\n')
    assert d["prefill_tps"] == pytest.approx(32.0) and d["decode_tps"] == pytest.approx(2.5)


def test_stats_table_mean_row():
    d = stats.parse_stats_table(STATS)
    assert d["io_bytes_per_token"] == pytest.approx(31.06e6)
    assert d["reads_per_token"] == 154 and d["hit_rate"] == pytest.approx(0.29)
    assert d["recall"] == pytest.approx(0.90)
    cells = stats.stat_cells(d)
    assert cells["mb_tok"] == "31.1" and cells["gibs"] == "0.64 (2.02)"
    assert cells["split"] == "50.2 / 4.3 / 28.7 / 0.0"
    assert stats.parse_stats_table(STATS.replace("hit%", "hits")) == {"plan": STATS.splitlines()[0]}


def test_merge_keeps_other_sections(tmp_path):
    old = tmp_path / "B.md"
    old.write_text("# t\n\nold head\n\n## I/O\n\nio text\n\n## Dense decode\n\nold dense\n\n## Quality\n\nq\n")
    text = report.merge(old, "# new\n", {"## Flash inference": "## Flash inference\n\nflash\n"})
    assert "old head" not in text and "io text" in text and "q\n" in text and "old dense" in text
    assert text.index("## Dense decode") < text.index("## Flash inference") < text.index("## I/O")


def test_benchmarks_md_is_the_reference_not_the_log():
    """BENCHMARKS.md: make bench's sections and the I/O and Quality tables, no dated section (those
    go to docs/history/), the picture, ≤ 400 lines; a new bench run keeps
    that (its sections replace theirs, the header is made again)."""
    path = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"
    again = report.merge(path, report.header(dict.fromkeys(
        ("date", "mode", "load", "machine", "llama_cpp"), "x")), {})
    for text in (path.read_text(encoding="utf-8"), again):
        assert len(text.splitlines()) <= 400
        assert re.findall(r"(?m)^## (.*)$", text) == [t[3:] for t in report.MINE] + ["I/O", "Quality"]
        assert not re.search(r"(?m)^#+ .*(session \d|20\d\d-\d\d-\d\d)", text)
        assert report.PICTURE in text


@needs_cgroup
def test_cap_kills_an_oversized_child_and_peak_stays_under_it():
    res = cgroup_run.run_capped([sys.executable, "-c", "b = bytearray(256 << 20); b[::4096] = b'x' * (len(b) // 4096)"],
                                64 * MiB)
    assert res.returncode == -9 and res.oom_kills >= 1 and res.failcnt > 0
    assert res.peak_bytes <= 64 * MiB


@needs_cgroup
def test_uncapped_group_measures_the_child():
    res = cgroup_run.run_capped([sys.executable, "-c", "b = bytearray(96 << 20); b[::4096] = b'x' * (len(b) // 4096)"])
    assert res.ok and res.failcnt == 0
    assert 96 * MiB <= res.peak_bytes < 512 * MiB
    assert not list(cgroup_run.ROOT.glob(f"flashllm_bench_{__import__('os').getpid()}_*"))


def test_run_json_flash_summary():
    line = ('{"n_prompt": 64, "prefill_s": 1.0, "n_decode": 3, "decode_s": 0.5, "prefill_tps": 64.0, '
            '"decode_tps": 6.0, "flash": {"plan": {"summary": "DRAM budget 170 MiB"}, "summary": '
            '{"io_bytes_per_token": 2.5e6, "reads_per_token": 12.0, "hit_rate": 0.5, "recall": null, '
            '"io_ms_per_token": 3.0, "mm_ms_per_token": 1.0, "compute_ms_per_token": 7.0, '
            '"predictor_ms_per_token": 0.04}}}')
    d = flashllm_cli.parse_run("note\n" + line + "\n")
    assert report.plan_label(d) == "DRAM budget 170 MiB"
    cells = stats.stat_cells(d)
    assert (cells["mb_tok"], cells["reads_tok"], cells["hit"]) == ("2.5", "12", "0.500")
    assert cells["recall"] == "–" and cells["split"] == "3.0 / 1.0 / 7.0 / 0.0"


def test_draft_passes_read_per_token_made():
    """A run that verified draft guesses: 10 decode passes kept 6 guesses (16 tokens after the
    prefill's), each pass read 8 MB of FFN, so a token made read 5 MB; the 34 MB of dense
    weights read over the prefill and the passes are 2 MB for each of the 17 tokens."""
    line = ('{"n_prompt": 64, "prefill_s": 1.0, "n_decode": 10, "decode_s": 2.0, "n_accepted": 6, '
            '"flash": {"summary": {"io_bytes_per_token": 8e6, "reads_per_token": 32.0, '
            '"decode_tokens": 10}, "dense": {"dense_bytes_read": 34e6}}}')
    cells = stats.stat_cells(flashllm_cli.parse_run(line + "\n"))
    assert (cells["mb_tok"], cells["reads_tok"]) == ("5.0 + 2", "20")


def test_portable_paths(tmp_path):
    cache, root = tmp_path / "cache", tmp_path / "repo"
    text = (f"flashllm run {cache}/converted/m-q4_1 -f {root}/build/bench/p.txt -o {Path.home()}/out "
            f"--other /x{root}/kept")
    assert report.portable(text, cache, root) == (
        f"flashllm run $FLASHLLM_CACHE/converted/m-q4_1 -f build/bench/p.txt -o ~/out --other /x{root}/kept")


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no SCHED_IDLE on this platform")
def test_read_probe_spinners_run_at_idle_priority_and_stop():
    from scripts.bench.read_probe import spinners
    procs = spinners(2)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
                os.sched_getscheduler(p.pid) != os.SCHED_IDLE for p in procs):
            time.sleep(0.05)
        assert [os.sched_getscheduler(p.pid) for p in procs] == [os.SCHED_IDLE] * 2
        assert all(p.poll() is None for p in procs)             # still spinning
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert all(p.poll() is not None for p in procs)


@pytest.mark.realmodel
def test_the_probed_floor_is_the_least_budget_a_run_takes(tmp_path):
    """The bench's SmolLM2 caps are its floor + a share of the FFN: the floor must be the least
    --dram-budget `flashllm run` takes. Its 1 MiB refusal is the tokenizer's, which also names
    that load's lower peak (the bench once read that as the floor and ran below it). The
    process is counted in 8 MiB steps (budget.process_rss), so a later run may measure one step
    more or less: then the floor holds within that step."""
    import subprocess
    from conftest import _converted
    from scripts.bench.bench import probe_floor
    model = _converted("smollm2-135m", "native", lambda m: None)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def add(a, b):\n    return")
    fl = flashllm_cli.Flashllm([sys.executable, "-m", "flashllm"])
    floor = probe_floor(fl, model, prompt, 8)
    assert floor is not None and floor % MiB == 0
    run = lambda budget: subprocess.run(fl.run_argv(model, prompt, 8, 2, ["--dram-budget",
                                                                          f"{budget // MiB}MiB"]),
                                        capture_output=True, text=True, timeout=300)
    ok, below = run(floor), run(floor - MiB)
    if ok.returncode or not below.returncode:   # the process is counted in whole steps
        ok, below = run(floor + PROCESS_STEP), run(floor - PROCESS_STEP - MiB)   # and moved one
    assert ok.returncode == 0, ok.stderr
    assert below.returncode == 1 and "least --dram-budget that works" in below.stderr


def test_the_uncapped_default_is_a_plain_run():
    """In RAM the bench's "flashllm (default)" is `run` as a user calls it, without a budget;
    under a cap it is the budgeted run, and only there does a --dense row stand beside it."""
    from scripts.bench import bench
    opts = {o: True for o in ("--stats", "--dram-budget", "--naive", "--dense", "--sparse-head")}
    free = dict((label, extra) for label, extra, _ in bench.contenders(None, True, opts))
    assert free["flashllm (default)"] == ["--stats"]
    assert "--dram-budget" in free["flashllm --naive"]
    assert not any(label.startswith("flashllm dense") for label in free)
    capped = dict((label, extra) for label, extra, _ in bench.contenders("560MiB", True, opts))
    assert capped["flashllm (default)"][:2] == ["--dram-budget", "560MiB"]
    assert "flashllm dense --dense" in capped


def test_budget_picture_points_from_the_flash_table():
    from scripts.bench import budget_plot
    text = ("## Flash inference\n\nRun: 2026-11-28 20:53, git eaad83c, full mode\n\n| model | cap | contender | decode tok/s |\n"
            "|---|---|---|---:|\n"
            "| qwen2.5-coder-1.5b | none | llama.cpp (repacked, OMP wait passive) | 23.01 |\n"
            "| qwen2.5-coder-1.5b | none | llama.cpp (repacked, OMP wait default) | 40.48 |\n"
            "| qwen2.5-coder-1.5b | none | flashllm (default) | 45.64 |\n"
            "| qwen2.5-coder-1.5b | 560 MiB | llama.cpp (mmap, OMP wait passive) | 1.15 |\n"
            "| qwen2.5-coder-1.5b | 560 MiB | flashllm --draft 0 | 7.73 |\n"
            "| qwen2.5-coder-1.5b | 560 MiB | flashllm (default) | 12.09 |\n"
            "| qwen2.5-coder-1.5b | 280 MiB | flashllm dense --dense | OOM-killed under the cap | | |\n"
            "| smollm2-135m | none | flashllm (default) | 240.50 |\n\n## Speculative decoding\n\n| x | y | z | 1 |\n")
    assert budget_plot.points(budget_plot.rows_from_markdown(text)) == [
        ("none", 45.64, 40.48), ("560 MiB", 12.09, 1.15), ("280 MiB", None, None)]
    assert budget_plot.run_note(text).startswith("make bench 2026-11-28 20:53, git eaad83c")


def test_the_serving_section_sets_each_round_against_one_client():
    """scripts/bench/serve.py's "## Serving" table: one line per round, the ratio column each
    round's aggregate decode rate over its server's 1-client round, the draft guesses kept of
    those checked, the cap's peak from the cgroup (else the process's RSS), a server that did
    not start one line saying why."""
    from scripts.bench import serve
    row = dict(aggregate_tps=1.0, per_stream_decode_tps=2.0, ttft_p50_s=0.5, ttft_p95_s=0.9,
               streams_per_pass=1.0, mib_read_per_token=500.0, peak_rss_mib=300)
    runs = [{"cap": "560MiB", "cmd": "flashllm serve M", "outcome": {"peak_mib": 501.5,
             "failcnt": 0, "oom_kills": 0},
             "rows": [{**row, "clients": 1, "aggregate_decode_tps": 2.0},
                      {**row, "clients": 4, "aggregate_decode_tps": 6.5, "draft_proposed": 40,
                       "draft_accepted": 30}]},
            {"cap": "280MiB", "cmd": "flashllm serve M", "rows": [], "outcome": {},
             "error": "serve exited with 1"}]
    text = serve.serve_section(runs, ("1.0", "2.0"))
    lines = [ln for ln in text.splitlines() if ln.startswith("| 560MiB") or
             ln.startswith("| 280MiB")]
    assert [ln.split(" | ")[4] for ln in lines[:2]] == ["1.00", "3.25"]
    assert [ln.split(" | ")[8] for ln in lines[:2]] == ["–", "30 / 40 (75%)"]   # guesses kept
    assert lines[0].rstrip(" |").endswith("501.5 / 300") and "serve exited with 1" in lines[2]
    assert text.startswith("## Serving\n") and "peak 501.5 MiB, failcnt 0" in text
