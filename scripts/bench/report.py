"""BENCHMARKS.md writing for bench.py: the header, the "## Dense decode" and
"## Flash inference" sections, the merge that keeps every other section (## I/O, ## Quality,
owned by other scripts) as it is in the file, and the portable form of the paths in them.
The other sections of make bench are written by their own modules (MINE lists them all)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional

MINE = ("## Dense decode", "## GGUFs in DRAM", "## Flash inference",
        "## Mixture of experts under a cap", "## Speculative decoding", "## Serving",
        "## Structured output")
TITLE = "# flashllm benchmarks"
PICTURE = "![decode tok/s against the DRAM cap, flashllm and llama.cpp](docs/budget.png)"


def fmt(x: Optional[float], digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def mib(n: Optional[int]) -> str:
    return "–" if not n else f"{n / 2**20:.0f}"


def portable(text: str, cache: Path, root: Path) -> str:
    """text with this machine's folders in the forms BENCHMARKS.md uses: the user cache as
    $FLASHLLM_CACHE, the repository's files relative to its root (every command runs there),
    the home folder as ~."""
    for folder, short in ((cache, "$FLASHLLM_CACHE/"), (root, ""), (Path.home(), "~/")):
        text = re.sub(r"(?<![\w.~$/-])" + re.escape(str(folder).rstrip("/")) + "/", short, text)
    return text


def header(info: Dict[str, str]) -> str:
    return "\n".join([
        TITLE, "",
        f"Last `make bench`: {info['date']} ({info['mode']} mode), load average at its start "
        f"{info['load']} (1/5/15 min).", "",
        f"Machine: {info['machine']}. llama.cpp: llama-cpp-python {info['llama_cpp']}.", "",
        "Absolute figures move with whatever else runs on the machine (each section states its "
        "run's date and load average) and with the device's read rate, which can drift by tens of "
        "percent within minutes: **compare ratios within one run**.", "",
        "llama.cpp's configuration. Uncapped rows: llama.cpp as its users run it in RAM, its "
        "default of weights repacked into anonymous memory for its CPU kernels (extra buffer "
        "types), warm, once with its default OpenMP wait policy (spinning) and once passive; the "
        "faster is the reference of the ratio columns. Capped rows: the weights file-backed (mmap "
        "with `use_extra_bufts=False`, scripts/llamacpp_params.py), so they stay in page cache that "
        "the memory cap charges and reclaims (a repacked copy would be counted or killed), from a "
        "cold page cache, its OpenMP threads passive. Tables made before this rule (noted where "
        "they are) compared uncapped rows with file-backed weights, which is slower in RAM.",
        "",
        "Commands are written to run from the repository root: `flashllm` is the console script "
        "(`make setup`; in a source tree without it, bench.py calls `python -c 'from "
        "flashllm.cli.app import main; main()'` with the same arguments), `python -m scripts.…` "
        "the scripts (scripts/README.md), `build/…` the repository's build folder, and "
        "`$FLASHLLM_CACHE` flashllm's user cache (the FLASHLLM_CACHE environment variable, else "
        "the platform's user cache folder, e.g. ~/.cache/flashllm on Linux), where `flashllm "
        "pull` puts models/NAME.gguf and the benchmark its converted/NAME-DTYPE folders.", "",
        "`make bench` (scripts/bench/bench.py) writes the sections \"Dense decode\", \"GGUFs in "
        "DRAM\", \"Flash inference\", \"Mixture of experts under a cap\", \"Speculative "
        "decoding\", \"Serving\" and \"Structured output\" (about 100 min on this machine, "
        "quiet: \"GGUFs in DRAM\" ~15, \"Mixture of experts under a cap\" ~12; a first run also "
        "converts their files, ~10 more; `--sections gguf,moe` runs some, each dated by its own "
        "lines, this header kept), and draws the 1.5B's rows of \"Flash inference\" as docs/budget.png (the README's "
        "picture); `make bench QUICK=1` is the SmolLM2-only development mode (no speculative, "
        "serving or MoE section, no picture). \"## I/O\" and "
        "\"## Quality\" come from their own scripts (the command is given with each table); the "
        "protocol is docs/DESIGN.md's \"Benchmark protocol\". This file is the reference, not the "
        "log: dated studies and the session notes that read these tables are in docs/history/ "
        "(its README lists them).", "",
        PICTURE, "",
    ])


def run_line(info: Dict[str, str], load_start: str, load_end: str) -> str:
    return (f"Run: {info['date']}, git {info['git']}, {info['mode']} mode; load average "
            f"(1/5/15 min) {load_start} at the start of this section, {load_end} at its end.")


def dense_section(info: Dict[str, str], rows: List[dict], load: tuple, notes: List[str]) -> str:
    out = ["## Dense decode", "", run_line(info, *load), "",
           "SmolLM2-135M, all weights in DRAM, 2 threads, warm page cache. flashllm: `flashllm "
           "run` on a 64-token code prompt (the opening of the evaluation split, heapq.py: "
           "text no calibration saw, exactly 64 tokens with BOS), "
           f"greedy, decode = tokens after the first (\"eval time\" line), median of {info['reps']} "
           "runs. flashllm's C kernel keeps its own worker threads (native/pool.c: they spin "
           "100 µs after a kernel call, then sleep), so no OpenMP setting applies to it. llama.cpp: "
           "scripts/bench/llamacpp.py on the source GGUF (Q4_1, file-backed: see above), 64 "
           f"fixed token ids, one batch prefill then tg{info['n_gen']}, one warm-up + median of the "
           "runs, with its OpenMP threads passive and spinning (default); the faster of the two is "
           "the reference of the ratio column.", "",
           "| engine | weights | decode tok/s | prefill tok/s | decode × llama.cpp | "
           "runs (prefill, decode) | cmd |",
           "|---|---|---:|---:|---:|---|---|"]
    ref = next((r["decode_tps"] for r in rows if r.get("ref") and r.get("decode_tps")), None)
    for i, r in enumerate(rows, 1):
        ratio = fmt(r["decode_tps"] / ref) if ref and r.get("decode_tps") else "–"
        runs = ", ".join(f"({a:.1f}, {b:.1f})" for a, b in r.get("runs", []))
        out.append(f"| {r['engine']} | {r['weights']} | {fmt(r.get('decode_tps'))} | "
                   f"{fmt(r.get('prefill_tps'))} | {ratio} | {runs or r.get('error', '')} | [{i}] |")
    out += ["", "Commands:", ""] + [f"{i}. `{r['cmd']}`" for i, r in enumerate(rows, 1)]
    return "\n".join(out + [""] + notes + [""])


FLASH_COLS = ("| model | cap | contender | decode tok/s | prefill tok/s | decode × llama.cpp | "
              "cgroup peak MiB | failcnt | FFN (+ dense) MB/tok | reads/tok | avg read KiB | GiB/s reading (profile) [adjacent probe: run ÷ probe] / whole decode | "
              "hit rate | recall / precision | ms/tok I/O / mm / compute / predictor | cmd |")


def flash_section(info: Dict[str, str], rows: List[dict], load: tuple, notes: List[str]) -> str:
    out = ["## Flash inference", "", run_line(info, *load), "",
           "docs/DESIGN.md's benchmark protocol. Every contender runs in its own cgroup-v1 memory "
           "group (scripts/bench/cgroup_run.py: memory.limit_in_bytes = the cap, page cache dropped before each "
           "run, peak = memory.max_usage_in_bytes, failcnt = times the cap was hit), 2 threads, "
           "one run per cell, cold (no warm-up) except llama.cpp uncapped (one warm-up run first: the "
           "in-RAM figure). flashllm: the model converted at the dtype shown, a "
           "64-token code prompt, greedy; \"(default)\": `run` as a user calls it, which under a "
           "budget that streams the FFN drafts from the resident neurons (`--draft-kind self`, "
           "issue 15) and, when the output head streams, reads only its candidate rows (the "
           "sparse head); under the Qwens' caps also `--draft 0` (no drafting), "
           "`--no-sparse-head` (the whole head streams) and both. llama.cpp: the source GGUF; "
           "uncapped as its users run it (weights repacked for its CPU kernels), its OpenMP threads "
           "passive and spinning (default), the faster the ratio's reference; capped, mmap with "
           "use_extra_bufts off (file-backed: a repacked copy is anonymous memory the cap would "
           "count or kill), passive (flashllm's kernel threads are its own: native/pool.c). "
           "FFN MB and reads a token: per token made (a pass that verifies draft guesses reads "
           "once for all it keeps). \"–\": the "
           "run does not report that figure; \"not available yet\": the `flashllm run` option it "
           "needs does not exist in this build. \"GiB/s reading\": the run's FFN reads (bytes / time "
           "in reads), against the saved device profile's figure at the run's read size and "
           "threads, and [in brackets] against the mean of two 4-s probes of the same random "
           "direct reads taken right before and right after the run (scripts/bench/read_probe.py: "
           "one profile cell measured longer; a disk whose rate drifts over seconds, as a virtual "
           "machine's may, is only judged fairly by an adjacent measurement: did the run leave the "
           "device idle?).", "",
           FLASH_COLS, "|---|---|---|" + "---:|" * 10 + "---|---|---|"]
    refs = {(r["model"], r["cap"]): r.get("decode_tps") for r in rows if r.get("ref")}
    cmds: List[str] = []
    plans: List[str] = []
    for r in rows:
        ref = refs.get((r["model"], r["cap"]))
        dec = r.get("decode_tps")
        ratio = fmt(dec / ref) if ref and dec else "–"
        cmd = f"[{len(cmds) + 1}]" if r.get("cmd") else ""
        if r.get("cmd"):
            cmds.append(r["cmd"])
            plan = plan_label(r.get("parsed") or {})
            plans += [f"- [{len(cmds)}] {plan}"] if plan else []
        s = r.get("stats", {})
        if r.get("error"):
            figures = f"{r['error']} |" + " |" * 11
        else:
            figures = (f"{fmt(dec)} | {fmt(r.get('prefill_tps'))} | {ratio} | {mib(r.get('peak'))} | "
                       f"{r.get('failcnt', '–')} | {s.get('mb_tok', '–')} | {s.get('reads_tok', '–')} | "
                       f"{s.get('avg_read_kib', '–')} | {s.get('gibs', '–')} | {s.get('hit', '–')} | "
                       f"{s.get('recall', '–')} | {s.get('split', '–')} |")
        out.append(f"| {r['model']} | {r['cap_label']} | {r['contender']} | {figures} {cmd} |")
    out += ["", "Commands:", ""]
    out += [f"{i}. `{c}`" for i, c in enumerate(cmds, 1)]
    plans = ["", "flashllm's DRAM plan per run (its `--stats` header):", ""] + plans if plans else []
    return "\n".join(out + plans + [""] + notes + [""])


def plan_label(parsed: dict) -> Optional[str]:
    """flashllm's DRAM plan line: from the --stats table header, or `run --json`'s flash.plan."""
    plan = parsed.get("plan") or ((parsed.get("flash") or {}).get("plan") or {}).get("summary")
    return plan if isinstance(plan, str) else None


def merge(path: Path, head: Optional[str], sections: Dict[str, str]) -> str:
    """The new file: head (None: the file's own, as a run of some sections keeps it), then my
    sections (new text where given, else the file's), then every other section of the existing
    file in its order."""
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    parts = re.split(r"(?m)^(?=## )", old)
    if head is None:
        head = parts[0].rstrip() + "\n" if parts[0].strip() else TITLE + "\n"
    kept: Dict[str, str] = {}
    others: List[str] = []
    for part in parts[1:]:
        title = part.splitlines()[0].strip()
        if title in MINE:
            kept[title] = part.rstrip() + "\n"
        else:
            others.append(part.rstrip() + "\n")
    mine = [sections.get(t, kept.get(t, "")).rstrip() + "\n" for t in MINE if t in sections or t in kept]
    return head + "\n" + "\n".join(mine + others)
