"""`make bench`'s "GGUFs in DRAM" section (issue 50's bar): one row per GGUF file, flashllm's
default conversion (native) against llama.cpp on the same file, all weights in DRAM.

Run:  python -m scripts.bench.bench --sections gguf [--quick] [--models NAME,...]
The files (ROWS): the four models.toml GGUFs (`flashllm pull`, or --models-dir), the 1.5B
re-quantized by llama.cpp to Q2_K and Q3_K_M (scripts/bench/requantize_gguf.py into build/gguf
when absent) and the OLMoE-shape Q4_0 fixture (scripts/fixtures/make_moe_gguf.py into build/moe
when absent, converted there as the "Mixture of experts under a cap" section converts it).
flashllm: `run` on a 64-token code prompt, -n 128 --ignore-eos, 2 threads, greedy, one
discarded run first (the page cache warm). llama.cpp: scripts/bench/llamacpp.py, repacked
weights, one warm-up and one measured run a process, OpenMP passive and default (spinning); per
figure the faster is the reference. The two take turns, 3 rounds of one flashllm run and one
llama.cpp run per policy, each the median of its 3: this machine's speed drifts by a quarter over
minutes, and runs taken in turn see the same spells. --quick: SmolLM2 only, 32 tokens, 1 round.
"""
from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from flashllm.format.layout import NATIVE
from scripts.bench import moe
from scripts.bench.flashllm_cli import ROOT, converted_dir, ensure_converted, make_prompt
from scripts.bench.harness import MiB, Bench, flashllm_row, gguf_for, llamacpp_row, loadavg, show_py
from scripts.bench.report import fmt, run_line
from scripts.fixtures.make_moe_gguf import write as write_gguf

TITLE = "## GGUFs in DRAM"
# row name -> the GGUF's weights, in words
ROWS = {"smollm2-135m": "Q4_1", "qwen2.5-coder-0.5b": "Q5_0 / Q8_0 / Q4_K / Q6_K",
        "qwen2.5-coder-1.5b": "Q4_K_M", "gemma-3-270m": "Q4_K_M",
        "qwen2.5-coder-1.5b-q2_k": "Q2_K (llama.cpp re-quantized)",
        "qwen2.5-coder-1.5b-q3_k_m": "Q3_K_M (llama.cpp re-quantized)",
        "olmoe-shape-q4_0": "Q4_0 (OLMoE-shape fixture, MoE)"}
REQUANT = {"qwen2.5-coder-1.5b-q2_k": ("qwen2.5-coder-1.5b", "Q2_K"),
           "qwen2.5-coder-1.5b-q3_k_m": ("qwen2.5-coder-1.5b", "Q3_K_M")}
POLICIES = ("passive", "default")


def gguf_of(b: Bench, name: str) -> Tuple[Path, str]:
    """(the GGUF of row name, made when absent; how it was had, for the notes)."""
    if name.startswith("olmoe-shape-"):
        path, kind = moe.BUILD / f"{name}.gguf", name.rsplit("-", 1)[1]
        if not path.is_file():
            write_gguf(path, kind, log=b.log)
        return path, f"`python -m scripts.fixtures.make_moe_gguf -o {path} --type {kind}`"
    if name in REQUANT:
        base, qtype = REQUANT[name]
        out = ROOT / "build" / "gguf" / f"{name}.gguf"
        argv = [sys.executable, "-m", "scripts.bench.requantize_gguf",
                str(gguf_for(b.fl, base, b.args.models_dir)), str(out), "--type", qtype]
        if not out.is_file():
            b.log(f"gguf: re-quantizing {base} to {qtype}")
            res = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
            if res.returncode != 0:
                raise RuntimeError(f"requantize_gguf failed: {res.stderr.strip()[-300:]}")
        return out, f"`{show_py(argv)}`"
    return gguf_for(b.fl, name, b.args.models_dir), f"`flashllm pull {name}`"


def converted(b: Bench, name: str) -> Path:
    """Where row name's default conversion lives: the MoE fixture's beside it in build/moe (the
    MoE section's), every other in the user cache as the registry names it."""
    if name.startswith("olmoe-shape-"):
        return moe.BUILD / f"olmoe-{name.rsplit('-', 1)[1]}-{NATIVE}"
    return converted_dir(b.args.cache, name, NATIVE)


def measure(b: Bench, name: str, n_gen: int) -> dict:
    """One row: the file, its conversion, flashllm's median run and llama.cpp's per policy."""
    gguf, made = gguf_of(b, name)
    out = converted(b, name)
    conv = ensure_converted(b.fl, gguf, out, NATIVE, b.log)
    prompt = b.args.work / f"prompt-{name}-{NATIVE}.txt"
    n = make_prompt(out, 64, "code", prompt)
    b.log(f"gguf: {name} ({n}-token prompt), {b.args.reps} rounds of flashllm and llama.cpp")
    fl, ll = [], {p: [] for p in POLICIES}
    for r in range(b.args.reps):     # in turn: a slow spell of the machine falls on both alike
        fl.append(flashllm_row(b.fl, out, prompt, n_gen, [], 1, None, False, b.opts["--json"],
                               b.args.timeout, warmup=r == 0))
        for policy in POLICIES:
            ll[policy].append(llamacpp_row(gguf, policy, 1, n_gen, None, True, b.args.timeout))
    return {"name": name, "weights": ROWS[name], "mib": gguf.stat().st_size / MiB, "made": made,
            "conv": conv, "n_prompt": n, "flashllm": merged(fl),
            "llama.cpp": {p: merged(rows) for p, rows in ll.items()}}


def merged(rows: List[dict]) -> dict:
    """One row of one-run rows: the first's command, every run, their median prefill and
    decode tok/s; the first failed row as it is."""
    for r in rows:
        if r.get("error"):
            return r
    runs = [run for r in rows for run in r["runs"]]
    return {**rows[0], "runs": runs, "prefill_tps": statistics.median(a for a, _ in runs),
            "decode_tps": statistics.median(d for _, d in runs)}


def ratio(r: dict, key: str) -> Tuple[str, str]:
    """(llama.cpp's key per policy "passive / default", flashllm's key × the faster of them)."""
    refs = [r["llama.cpp"][p].get(key) for p in POLICIES]
    mine, best = r["flashllm"].get(key), max((x for x in refs if x), default=None)
    return " / ".join(fmt(x) for x in refs), fmt(mine / best) if mine and best else "–"


def cell(text: str) -> str:
    return text.replace("|", "/")


def table(rows: List[dict]) -> List[str]:
    out = ["| GGUF | weights | MiB | flashllm decode tok/s | flashllm prefill tok/s | llama.cpp "
           "decode tok/s (passive / default) | llama.cpp prefill tok/s (passive / default) | "
           "decode × llama.cpp | prefill × llama.cpp |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("error"):
            out.append(f"| {r['name']} | {r['weights']} | – | {cell(r['error'])} |" + " – |" * 5)
            continue
        fl = r["flashllm"]
        (ll_dec, x_dec), (ll_pre, x_pre) = ratio(r, "decode_tps"), ratio(r, "prefill_tps")
        mine = (f"{fmt(fl.get('decode_tps'))} | {fmt(fl.get('prefill_tps'))}" if not fl.get("error")
                else f"{cell(fl['error'])} | –")
        out.append(f"| {r['name']} | {r['weights']} | {r['mib']:.0f} | {mine} | {ll_dec} | "
                   f"{ll_pre} | {x_dec} | {x_pre} |")
    return out


def show(row: dict) -> str:
    """A row's runs as "(prefill, decode), ...", or "–" without any."""
    return ", ".join(f"({a:.1f}, {d:.1f})" for a, d in row.get("runs", [])) or "–"


def notes(rows: List[dict]) -> List[str]:
    """Per row: how the file was had, its conversion, flashllm's and llama.cpp's commands and
    each run's figures."""
    out = []
    for r in (r for r in rows if not r.get("error")):
        fl, ll = r["flashllm"], r["llama.cpp"]
        out.append(f"- {r['name']}: {r['made']}; `{r['conv']}`; `{fl['cmd']}` ({r['n_prompt']}-token "
                   f"prompt; runs (prefill, decode) {show(fl)}); `{ll['passive']['cmd']}` (runs "
                   f"{show(ll['passive'])}) and the same with `--omp-wait-policy default` (runs "
                   f"{show(ll['default'])}).")
    return out


def section_text(b: Bench, rows: List[dict], load: tuple, n_gen: int) -> str:
    text = [TITLE, "", run_line(b.info, *load), "",
            "Issue 50's bar: every GGUF at least as fast as llama.cpp with all weights in DRAM, "
            "2 threads, on the same file. flashllm: the default conversion (`flashllm convert "
            "X.gguf`, what `run X.gguf` does: native, each tensor in the GGUF's own type), `run` "
            f"on a 64-token code prompt (the evaluation split's heapq.py), -n {n_gen} "
            "--ignore-eos, greedy, one discarded run first (the page cache warm). llama.cpp: "
            f"scripts/bench/llamacpp.py, its default of repacked weights, 64 fixed token ids then "
            f"tg{n_gen}, one warm-up and one measured run a process, its OpenMP threads passive "
            "and spinning (default). The engines take turns: "
            f"{b.args.reps} rounds of one flashllm run and one llama.cpp run per policy (this "
            "machine's speed drifts over minutes; runs in turn share its spells), each figure "
            "the median of its rounds; each ratio is against the faster policy on that figure.",
            ""]
    text += table(rows) + ["", "Commands (the file; its conversion; the runs):", ""] + notes(rows)
    return "\n".join(text) + "\n"


def names(b: Bench) -> List[str]:
    """The rows this run measures: ROWS, or SmolLM2 alone with --quick, or the --models named."""
    return [n for n in ROWS if b.wants(n, not b.args.quick or n == "smollm2-135m")]


def section(b: Bench) -> Optional[Tuple[str, str, list]]:
    """(title, text, raw rows) of names(b), or None when there are none."""
    if not names(b):
        return None
    n_gen, start = 32 if b.args.quick else 128, loadavg()
    rows = []
    for name in names(b):
        try:
            rows.append(measure(b, name, n_gen))
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:   # no file, no conversion
            b.log(f"gguf: {name}: {e}")
            rows.append({"name": name, "weights": ROWS[name], "error": str(e).splitlines()[-1][:150]})
    return TITLE, section_text(b, rows, (start, loadavg()), n_gen), rows
