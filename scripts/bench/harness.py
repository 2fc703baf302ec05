"""What every `make bench` section shares: the run's context (Bench), the load average, where a
model's GGUF is, and the two measured rows: a `flashllm run` (median of repeated runs) and
scripts/bench/llamacpp.py on the same GGUF, each in its own memory cgroup when there is one.

Used by bench.py and the section modules (gguf_dram.py, moe_caps.py, draft.py, serve.py,
grammar.py); every figure comes from a subprocess whose command the section prints.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

from scripts.bench.cgroup_run import unavailable_reason
from scripts.bench.flashllm_cli import ROOT, Flashllm, parse_run, run_cmd
from scripts.bench.stats import parse_stats_table

MiB = 1 << 20


@dataclass
class Bench:
    """One `make bench` run as its sections see it: the options (quick, reps, cache, work,
    models_dir, models, timeout), the CLI measured and the `run` options it has, the machine
    line of the report and the progress log."""
    args: argparse.Namespace
    fl: Flashllm
    opts: Dict[str, bool]
    info: Dict[str, str]
    log: Callable[[str], None]

    def wants(self, name: str, default: bool = True) -> bool:
        """Whether a row named name runs: --models names it, else default."""
        return name in self.args.models if self.args.models else default


def loadavg() -> str:
    return " / ".join(open("/proc/loadavg").read().split()[:3])


def under_caps(b: Bench, title: str, collect: Callable[[list], list],
               write: Callable[[list, tuple], str]) -> Optional[tuple]:
    """A section of the 1.5B uncapped, then under 560 and 280 MiB where cgroups work:
    (title, write(rows, load at start and end), rows) with rows = collect(caps); None with
    --quick."""
    if b.args.quick:
        return None
    start = loadavg()
    rows = collect([None] + (["560MiB", "280MiB"] if not unavailable_reason() else []))
    return title, write(rows, (start, loadavg())), rows


def gguf_for(fl: Flashllm, name: str, models_dir: Optional[Path]) -> Path:
    """NAME.gguf in models_dir when there, else `flashllm pull NAME` (once: the user cache
    keeps it)."""
    local = models_dir / f"{name}.gguf" if models_dir else None
    if local and local.is_file():
        return local
    res = subprocess.run(fl.argv + ["pull", name], capture_output=True, text=True, cwd=ROOT, check=True)
    return Path(res.stdout.strip().splitlines()[-1])


def failure(raw: dict) -> str:
    if raw.get("error"):
        return raw["error"]
    if raw.get("oom"):
        return f"OOM-killed under the cap (peak {raw.get('peak', 0) / MiB:.0f} MiB)"
    tail = (raw.get("stderr") or "").strip().splitlines()[-1:] or ["no output"]
    return f"failed (exit {raw['rc']}): {tail[0][:120]}"


def llamacpp_argv(gguf: Path, policy: str, reps: int, n_gen: int, warm: bool,
                  repack: bool) -> List[str]:
    argv = [sys.executable, "-m", "scripts.bench.llamacpp", "--model", str(gguf), "--threads", "2",
            "--reps", str(reps), "--n-gen", str(n_gen), "--omp-wait-policy", policy, "--json"]
    return argv + ([] if warm else ["--no-warmup"]) + (["--repack"] if repack else [])


def show_py(argv: List[str]) -> str:
    return " ".join(["python"] + argv[1:])


def capped(cmd: str, cap: Optional[int]) -> str:
    """cmd as run by the flash section: in its own memory cgroup, cold cache."""
    limit = f" --limit {cap // MiB}MiB" if cap else ""
    return f"python -m scripts.bench.cgroup_run --cold{limit} -- {cmd}"


def llamacpp_row(gguf: Path, policy: str, reps: int, n_gen: int, cap: Optional[int], warm: bool,
                 timeout: float) -> dict:
    """llama.cpp on gguf: uncapped its default of repacked weights, capped file-backed; warm:
    one warm-up run in the process first; the median of reps runs."""
    argv = llamacpp_argv(gguf, policy, reps, n_gen, warm, repack=cap is None)
    raw = run_cmd(argv, cap, cold=True, timeout=timeout)  # warm: the warm-up runs in-process
    row = {"cmd": show_py(argv), "raw": raw, "peak": raw.get("peak"), "failcnt": raw.get("failcnt")}
    try:
        data = json.loads(raw["stdout"].strip().splitlines()[-1])
    except (KeyError, IndexError, ValueError, AttributeError):
        return {**row, "error": failure(raw)}
    return {**row, "decode_tps": data["decode_tps"], "prefill_tps": data["prefill_tps"],
            "runs": [(a, b) for a, b in data["runs"]]}


def flashllm_row(fl: Flashllm, model: Path, prompt: Path, n_gen: int, extra: List[str], reps: int,
                 cap: Optional[int], cold: bool, as_json: bool, timeout: float,
                 warmup: bool = False) -> dict:
    """`flashllm run` reps times (after one discarded run when warmup: the model's files in the
    page cache), the median prefill and decode tok/s and each run's (prefill, decode)."""
    argv = fl.run_argv(model, prompt, n_gen, 2, extra, as_json=as_json)
    row = {"cmd": fl.show(argv), "runs": [], "raws": []}
    if warmup:
        raw = run_cmd(argv, cap, cold=cold, timeout=timeout)
        if raw.get("rc") != 0:
            return {**row, "error": failure(raw)}
    for _ in range(reps):
        raw = run_cmd(argv, cap, cold=cold, timeout=timeout)
        row["raws"].append({k: v for k, v in raw.items() if k != "stdout"})
        text = (raw.get("stderr") or "") + "\n" + (raw.get("stdout") or "")  # --json may use either
        parsed = parse_run(text) if raw.get("rc") == 0 else None
        if parsed is None:
            return {**row, "error": failure(raw)}
        parsed.update(parse_stats_table(raw["stderr"]))
        row["runs"].append((parsed["prefill_tps"], parsed["decode_tps"]))
        row.update(peak=max(row.get("peak") or 0, raw.get("peak") or 0), failcnt=raw.get("failcnt"),
                   parsed=parsed, n_decode=parsed.get("n_decode"))
    row["prefill_tps"] = statistics.median(a for a, _ in row["runs"])
    row["decode_tps"] = statistics.median(b for _, b in row["runs"])
    return row
