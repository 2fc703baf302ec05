"""`make bench`: docs/DESIGN.md's benchmark protocol, written to BENCHMARKS.md (sections "Dense
decode", "GGUFs in DRAM", "Flash inference", "Mixture of experts under a cap", "Speculative
decoding", "Serving" and "Structured output"; every other section of the file is kept).

Run:  python -m scripts.bench.bench [--quick] [--sections dense,gguf,flash,moe,draft,serve,grammar]
                                    [--models NAME,...] [--out BENCHMARKS.md]

Dense decode (issue 2): SmolLM2-135M converted at f16 / q8_0 / q4_0 / q4_1, `flashllm run` decode and
prefill tok/s (median of 3), next to llama.cpp on the same GGUF with both OMP wait policies (the
faster is the reference).
GGUFs in DRAM (issue 50): every GGUF's default conversion against llama.cpp in DRAM (gguf_dram.py).
Flash inference (issues 4/5): Qwen2.5-Coder-1.5B and SmolLM2-135M under cgroup-v1 memory caps, cold
cache, flashllm (default) / --naive / dense and llama.cpp; the rows whose `flashllm run` option does
not exist yet say "not available yet". --quick: SmolLM2 only, 32 tokens, one run each.
Each capped flashllm row is bracketed by two 4-s read probes (read_probe.py) so its read rate
can be set against the device's rate of those minutes.
Mixture of experts under a cap (issue 52): moe.py's table of the OLMoE-shape fixtures (moe_caps.py).
Speculative decoding: draft.py's editing prompt, flashllm --draft 0 / 8 and llama.cpp
plain / prompt lookup, uncapped, 560 MiB and 280 MiB (not with --quick).
Serving (issue 49): `flashllm serve` on the 1.5B with 1, 2, 4 and 8 concurrent streaming
clients, uncapped, 560 MiB and 280 MiB (serve.py; not with --quick).
Structured output (issue 51): scripts/bench/grammar.py's JSON schemas at temperature 0.8 (valid /
cut / invalid), the mask's cost in DRAM and a constrained token's head bytes under 560 MiB
(--quick: SmolLM2, 5 prompts, no budget run).
--models: only the rows of these models or files (GGUFs in DRAM, the MoE fixtures as
olmoe-shape-q4_0 / olmoe-shape-q4_k_m), e.g. to check a section on its smallest case.
Each section is a function of the run's context (harness.Bench) in its module, returning its
title, text and raw rows, or None when it does not run here.
Paths in BENCHMARKS.md are written portably (report.portable: $FLASHLLM_CACHE/..., build/...).
Raw results (stderr tails, stats JSON) go to build/bench.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

from flashllm.cli.app import cache_dir
from flashllm.storage.profile import device_of
from scripts.bench import budget_plot, draft, grammar, gguf_dram, moe_caps, serve
from scripts.bench.cgroup_run import unavailable_reason
from scripts.bench.flashllm_cli import (ROOT, Flashllm, converted_dir, ensure_calibrated, ensure_converted,
                                        make_prompt)
from scripts.bench.harness import MiB, Bench, capped, flashllm_row, gguf_for, llamacpp_row, loadavg
from scripts.bench.read_probe import probe
from scripts.bench.report import dense_section, flash_section, header, merge, portable
from scripts.bench.stats import stat_cells

# name -> flash dtype; the GGUF (NAME.gguf) is looked up in --models-dir, else pulled
# (once: `flashllm pull` keeps it in the user cache). The 1.5B runs at its default conversion (native:
# the GGUF's own Q4_K / Q6_K tensors, down columns re-quantized; docs/QUALITY.md), as
# `flashllm run NAME` makes it; SmolLM2 at q4_1, which re-quantizes its Q4_1 blocks exactly.
MODELS = {"qwen2.5-coder-1.5b": "native", "qwen2.5-coder-0.5b": "native", "smollm2-135m": "q4_1"}
CAPS = {"qwen2.5-coder-1.5b": [560 * MiB, 280 * MiB],     # issues 4/5/15: 560 MiB / 280 MiB
        "qwen2.5-coder-0.5b": [280 * MiB]}                # issue 14: the 0.5B in RAM, and one cap


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def disk_words(path: Path) -> str:
    """The kind of block device holding path, in words, from its kernel name."""
    name = device_of(path).name
    kinds = (("nvme", "an NVMe drive"), ("vd", "a virtio disk"), ("xvd", "a Xen virtual disk"),
             ("sd", "a SCSI/SATA disk"), ("mmcblk", "an eMMC/SD card"))
    return next((words for prefix, words in kinds if name.startswith(prefix)), f"block device {name}")


def machine_words(work: Path) -> str:
    """'Intel(R) Xeon(R) Processor, 2 cores, 24 GiB RAM, no swap, a virtio disk'."""
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    swap = next((int(ln.split()[1]) for ln in open("/proc/meminfo") if ln.startswith("SwapTotal:")), 0)
    swap_words = f"{swap / 2**20:.0f} GiB swap" if swap else "no swap"
    return f"{cpu}, {os.cpu_count()} cores, {ram:.0f} GiB RAM, {swap_words}, {disk_words(work)}"


def machine_info(args) -> Dict[str, str]:
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=ROOT).stdout.strip()
    try:
        import llama_cpp
        llv = llama_cpp.__version__
    except ImportError:
        llv = "not installed"
    return {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            "machine": machine_words(args.work), "git": git, "llama_cpp": llv,
            "mode": "quick" if args.quick else "full", "reps": str(args.reps),
            "n_gen": "32" if args.quick else "128", "load": loadavg()}


def dense_rows(args, fl: Flashllm, opts: Dict[str, bool]) -> tuple:
    gguf = gguf_for(fl, "smollm2-135m", args.models_dir)
    rows, notes = [], []
    n_gen = 32 if args.quick else 128
    for dtype in (["q8_0"] if args.quick else ["f16", "q8_0", "q4_0", "q4_1"]):
        out = converted_dir(args.cache, "smollm2-135m", dtype)
        conv = ensure_converted(fl, gguf, out, dtype, log)
        prompt = args.work / f"prompt-smollm2-{dtype}.txt"
        n = make_prompt(out, 64, "code", prompt)
        log(f"dense: flashllm smollm2-135m {dtype}")
        row = flashllm_row(fl, out, prompt, n_gen, [], args.reps, None, False, opts["--json"], 600)
        rows.append({**row, "engine": "flashllm (dense)", "weights": f"{dtype} (converted)"})
        notes.append(f"- {dtype}: converted with `{conv}`; prompt {n} tokens; decoded "
                     f"{row.get('n_decode', '–')} tokens per run.")
    refs = []
    for policy in ["passive", "default"]:
        log(f"dense: llama.cpp {policy}")
        row = llamacpp_row(gguf, policy, args.reps, n_gen, None, True, 600)
        refs.append({**row, "engine": f"llama.cpp (repacked, OMP wait {policy})",
                     "weights": "Q4_1 GGUF"})
    max(refs, key=lambda r: r.get("decode_tps") or 0.0)["ref"] = True   # its faster policy
    return rows + refs, notes


def probe_floor(fl: Flashllm, model: Path, prompt: Path, n_gen: int) -> Optional[int]:
    """The least --dram-budget `flashllm run` accepts for this model (bytes), from its refusal
    of a 1 MiB budget (its "least --dram-budget that works", else older builds' "give at
    least"); None when the CLI does not say. (A refusal for the tokenizer's load also names
    that load's peak, which is less: never read as the floor.)"""
    argv = fl.run_argv(model, prompt, n_gen, 2, ["--dram-budget", "1MiB"])
    res = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300)
    m = re.search(r"least --dram-budget that works for this model and context: (\d+) MiB",
                  res.stderr) or re.search(r"give at least (\d+) MiB", res.stderr)
    return int(m.group(1)) * MiB if m else None


def flash_caps(name: str, floor: Optional[int], ffn_bytes: int) -> List[tuple]:
    """(cap bytes or None, label) per budget of this model: the Qwens the issues' caps (CAPS);
    SmolLM2 (fits in any of those) flashllm's floor + 50% / 25% of the FFN."""
    caps = [(None, "none")]
    if name in CAPS:
        return caps + [(c, f"{c // MiB} MiB") for c in CAPS[name]]
    fractions = [0.5, 0.25]
    if floor:
        caps += [(floor + int(f * ffn_bytes), f"{(floor + int(f * ffn_bytes)) // MiB} MiB "
                  f"(floor + {f:.0%} FFN)") for f in fractions]
    return caps


def contenders(budget: Optional[str], fits: bool, opts: Dict[str, bool],
               reads_less: bool = False) -> List[tuple]:
    """(label, extra run options, missing option or None) for one cap; reads_less: also the
    options that change a capped run's bytes a token (`--no-sparse-head` streams the whole
    output head, `--draft 0` turns off the self-drafting a run under a budget does by default)."""
    stats = ["--stats"] if opts["--stats"] else []
    b = ["--dram-budget", budget or "16GiB"]  # unlimited: more than the model needs

    def missing(*names: str) -> Optional[str]:
        return next((n for n in names if not opts[n]), None)

    # uncapped, the default is `run` as a user in RAM calls it: no budget (the dense path)
    rows = [("flashllm (default)", (b if budget else []) + stats, missing("--dram-budget")),
            ("flashllm --naive", b + ["--naive"] + stats, missing("--dram-budget", "--naive"))]
    if budget and reads_less:           # issue 15: the default's self-draft and sparse head off
        rows += [("flashllm --draft 0", b + ["--draft", "0"] + stats, missing("--dram-budget")),
                 ("flashllm --no-sparse-head", b + ["--no-sparse-head"] + stats,
                  missing("--dram-budget", "--sparse-head")),
                 ("flashllm --no-sparse-head --draft 0",
                  b + ["--no-sparse-head", "--draft", "0"] + stats,
                  missing("--dram-budget", "--sparse-head"))]
    if fits and budget:             # uncapped, the default row is this run already
        dense = ["--dense"] if opts["--dense"] else []
        rows.append(("flashllm dense" + (" --dense" if dense else " (default run)"), dense, None))
    return rows


PROBE_CHUNK, PROBE_S = 256 * 1024, 4.0   # the bracketing read probes of each capped flashllm run


def flash_rows(args, fl: Flashllm, opts: Dict[str, bool]) -> tuple:
    rows, notes = [], []
    names = ["smollm2-135m"] if args.quick else list(MODELS)
    n_gen = 32 if args.quick else 128
    threads = 8                  # reads in flight of the first probe; then the last run's
    for name in names:
        gguf = gguf_for(fl, name, args.models_dir)
        dtype = MODELS[name]
        out = converted_dir(args.cache, name, dtype)
        conv = ensure_converted(fl, gguf, out, dtype, log)
        out, cal = ensure_calibrated(fl, out, log)        # every flashllm row runs the calibrated copy
        size = sum(p.stat().st_size for p in out.iterdir() if p.is_file() and p.name != "predictor.bin")
        prompt = args.work / f"prompt-{name}-{dtype}.txt"
        n = make_prompt(out, 64, "code", prompt)
        notes.append(f"- {name}: `{conv}`, then `{cal}` ({size / MiB:.0f} MiB on flash without the "
                     f"predictor); prompt {n} tokens; llama.cpp reads {gguf.name} "
                     f"({gguf.stat().st_size / MiB:.0f} MiB).")
        floor = probe_floor(fl, out, prompt, n_gen) if opts["--dram-budget"] else None
        ffn = int(json.loads((out / "manifest.json").read_text())["ffn"]["nbytes"])  # ffn-hot.bin once calibrated
        notes.append(f"- {name}: flashllm's least --dram-budget (its refusal of 1 MiB): "
                     f"{floor // MiB if floor else '–'} MiB; FFN {ffn / MiB:.0f} MiB.")
        for cap, label in flash_caps(name, floor, ffn):
            budget = f"{cap // MiB}MiB" if cap else None
            base = {"model": name, "cap": cap, "cap_label": label}
            rows += llamacpp_refs(base, gguf, n_gen, cap, args.timeout)
            fits = cap is None or cap > 2 * size
            for contender, extra, missing in contenders(budget, fits, opts, name in CAPS):
                if missing:
                    rows.append({**base, "contender": contender,
                                 "error": f"not available yet (no `run {missing}`)"})
                    continue
                log(f"flash: {contender} {name} cap {label}")
                ffn_file = out / json.loads((out / "manifest.json").read_text())["ffn"]["file"]
                before = probe(ffn_file, PROBE_CHUNK, threads, PROBE_S) if cap else None
                row = flashllm_row(fl, out, prompt, n_gen, extra, 1, cap, True, opts["--json"],
                                   args.timeout)
                row["cmd"] = capped(row["cmd"], cap)
                flash = (row.get("parsed") or {}).get("flash") or {}
                threads = flash.get("read_threads", threads)
                if before and flash:        # right after, at the run's read size and threads
                    size = (flash.get("summary") or {}).get("avg_read_bytes") or PROBE_CHUNK
                    after = probe(ffn_file, int(size), threads, PROBE_S)
                    same = [p["gib_s"] for p in (before, after) if p["threads"] == threads]
                    row["probe"] = {"before": before, "after": after,   # at the run's threads
                                    "gib_s": sum(same) / len(same)}
                row["stats"] = stat_cells(row.get("parsed") or {},
                                          (row.get("probe") or {}).get("gib_s"))
                rows.append({**base, **row, "contender": contender})
    return rows, notes


def llamacpp_refs(base: dict, gguf: Path, n_gen: int, cap: Optional[int], timeout: float) -> list:
    """llama.cpp's rows of one cap, the reference marked: uncapped, its OpenMP threads passive and
    spinning (default), one warm-up run first (the in-RAM figure), the faster the reference;
    capped, passive (spinning threads take the core its page faults need), the cold first run."""
    rows = []
    for policy in ["passive"] + (["default"] if cap is None else []):
        log(f"flash: llama.cpp {base['model']} cap {base['cap_label']} (OMP wait {policy})")
        row = llamacpp_row(gguf, policy, 1, n_gen, cap, cap is None, timeout)
        row["cmd"] = capped(row["cmd"], cap)
        weights = "repacked" if cap is None else "mmap"
        rows.append({**base, **row, "contender": f"llama.cpp ({weights}, OMP wait {policy})"})
    best = max(rows, key=lambda r: r.get("decode_tps") or 0.0)
    best["ref"] = True
    return rows


def reprofile(fl: Flashllm, work: Path) -> Optional[str]:
    """Re-take the device profile the flash rows are set against (this device's read rate drifts by
    tens of percent over hours); the note that says so, or None when profiling failed."""
    argv = fl.argv + ["profile", str(work), "--size", "2GiB", "--seconds", "30"]
    log("flash: re-taking the device profile")
    res = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=900)
    if res.returncode != 0:
        log(f"profile failed: {res.stderr.strip()[-200:]}")
        return None
    when = datetime.datetime.now().strftime("%H:%M")
    return (f"- device profile re-taken at {when}, before these rows (`{fl.show(argv)}`): the "
            f"\"(profile)\" figures.")


def draw_picture(rows: List[dict], info: Dict[str, str]) -> None:
    """docs/budget.png (the README's picture) from this run's flash rows, when it has the 1.5B's."""
    pts = budget_plot.points(rows)
    if not pts:
        return
    note = budget_plot.note(info["date"], info["git"])
    try:
        log(f"wrote {budget_plot.draw(pts, ROOT / 'docs' / 'budget.png', note)}")
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[bench]'): docs/budget.png not redrawn")


def dense(b: Bench) -> tuple:
    start = loadavg()
    rows, notes = dense_rows(b.args, b.fl, b.opts)
    return "## Dense decode", dense_section(b.info, rows, (start, loadavg()), notes), rows


def flash(b: Bench) -> tuple:
    start = loadavg()
    profiled = reprofile(b.fl, b.args.work) if not b.args.quick else None
    rows, notes = flash_rows(b.args, b.fl, b.opts)
    notes += [profiled] if profiled else []
    reason = unavailable_reason()
    notes += [f"- cgroup: {reason}: capped rows skipped."] if reason else []
    draw_picture(rows, b.info)
    return "## Flash inference", flash_section(b.info, rows, (start, loadavg()), notes), rows


# --sections name -> the section: (title, markdown, raw rows) or None where it does not run
SECTIONS: Dict[str, Callable[[Bench], Optional[tuple]]] = {
    "dense": dense, "gguf": gguf_dram.section, "flash": flash, "moe": moe_caps.section,
    "draft": draft.section, "serve": serve.section, "grammar": grammar.section}


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="SmolLM2 only, 32 tokens, one run each")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="any of " + ", ".join(SECTIONS))
    ap.add_argument("--models", default="", help="only these rows of the GGUF and MoE sections "
                    "(e.g. smollm2-135m,olmoe-shape-q4_0)")
    ap.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    ap.add_argument("--models-dir", type=Path, default=None,
                    help="a folder of GGUF files named NAME.gguf (default: `flashllm pull` them)")
    ap.add_argument("--cache", type=Path, default=None, help="flashllm's user cache (default: the CLI's)")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    args = ap.parse_args()
    unknown = [s for s in args.sections.split(",") if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section {', '.join(unknown)} (known: {', '.join(SECTIONS)})")
    args.models = [m for m in args.models.split(",") if m]
    args.reps = 1 if args.quick else 3
    args.cache = args.cache or cache_dir()
    args.work = ROOT / "build" / "bench"
    return args


def main() -> None:
    args = arguments()
    args.work.mkdir(parents=True, exist_ok=True)
    fl = Flashllm.find(sys.executable)
    opts = fl.options()
    fl.fixed_length = opts["--ignore-eos"]          # every row makes its -n tokens
    b = Bench(args, fl, opts, machine_info(args), log)
    log(f"flashllm run options: {opts}; cgroup: {unavailable_reason() or 'available'}")
    raw = {"info": b.info, "options": opts}
    every = set(args.sections.split(",")) == set(SECTIONS)   # else the file's header stays
    for name in (s for s in SECTIONS if s in args.sections.split(",")):
        done = SECTIONS[name](b)
        if not done:
            continue
        title, text, raw[name] = done      # written as each ends: a later failure keeps it
        write(args.out, merge(args.out, header(b.info) if every else None,
                              {title: portable(text, args.cache, ROOT)}))
        write(ROOT / "build" / "bench.json", json.dumps(raw, indent=1, default=str))
        log(f"wrote {title} into {args.out} (raw results: build/bench.json)")


def write(path: Path, text: str) -> None:
    """path's new text, whole or not at all."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)

if __name__ == "__main__":
    main()
