"""Speculative decoding on an editing prompt: flashllm --draft against llama.cpp's prompt lookup.

Run:  python -m scripts.bench.draft [--caps none,560MiB] [--n-gen 128] [--draft 8]
      [--out build/bench-draft.json]
The prompt (ChatML, written to build/bench/edit-prompt.txt) asks Qwen2.5-Coder-1.5B to add type
hints to textwrap.dedent and rename a variable: an answer that mostly repeats its context, where
prompt lookup pays. Per cap (none = all weights in DRAM, warm; a cap = cold page cache under a
memory cgroup, as the main benchmark): flashllm `run` greedy with --draft 0 and --draft N on the
calibrated native model (the default conversion), and llama.cpp (Q4_K_M GGUF) plain and with LlamaPromptLookupDecoding(N).
Prints a markdown table (decode tok/s, tokens per pass, ratios) and writes the raw JSON.
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import textwrap
from pathlib import Path

from flashllm.cli.app import cache_dir
from scripts.bench.cgroup_run import parse_size
from scripts.bench.flashllm_cli import ROOT, parse_run, run_cmd
from scripts.bench.harness import Bench, under_caps
from scripts.bench.report import portable

MODEL = Path("converted") / "qwen2.5-coder-1.5b-native-cal"    # in the user cache: bench.py's
GGUF = Path("models") / "qwen2.5-coder-1.5b.gguf"             # what `flashllm pull` writes


def edit_prompt() -> str:
    code = inspect.getsource(textwrap.dedent)
    return ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
            "assistant.<|im_end|>\n<|im_start|>user\nAdd type hints to this function and rename "
            "the variable `margin` to `common_prefix`. Reply with the whole function only.\n\n"
            f"```python\n{code}```<|im_end|>\n<|im_start|>assistant\n")


def flashllm_row(cache: Path, prompt: Path, cap, n_gen: int, draft: int) -> dict:
    argv = [sys.executable, "-m", "flashllm", "run", str(cache / MODEL), "-f", str(prompt), "-n",
            str(n_gen), "-t", "2", "-c", "1024", "--temp", "0", "--draft", str(draft), "--json"]
    if cap is not None:
        argv += ["--dram-budget", cap]
    raw = run_cmd(argv, parse_size(cap) if cap else None, cold=cap is not None, timeout=1800)
    d = parse_run(raw.get("stderr") or "") or {}
    per_pass = (d.get("n_decode", 0) + d.get("n_accepted", 0)) / max(d.get("n_decode", 0), 1)
    return {"engine": "flashllm", "draft": draft, "cap": cap, "decode_tps": d.get("decode_tps"),
            "per_pass": per_pass, "n_gen": d.get("n_gen"), "text": raw.get("stdout", "")[:80],
            "cmd": "flashllm " + " ".join(argv[3:])}


def llamacpp_row(cache: Path, prompt: Path, cap, n_gen: int, draft: int) -> dict:
    argv = [sys.executable, "-m", "scripts.bench.llamacpp_text", "--model", str(cache / GGUF),
            "--prompt", str(prompt), "--n-gen", str(n_gen), "--draft", str(draft)]
    if cap is not None:
        argv += ["--no-warmup", "--omp-wait-policy", "passive"]
    raw = run_cmd(argv, parse_size(cap) if cap else None, cold=cap is not None, timeout=3600)
    lines = [ln for ln in (raw.get("stdout") or "").splitlines() if ln.startswith("{")]
    d = json.loads(lines[-1]) if lines else {}
    tail = (raw.get("stderr") or "").strip().splitlines()[-1:] or ["no output"]
    error = None if d else ("OOM-killed under the cap" if raw.get("oom") else tail[0][:100])
    return {"engine": "llama.cpp", "draft": draft, "cap": cap, "decode_tps": d.get("decode_tps"),
            "error": error,
            "per_pass": None, "n_gen": d.get("n_gen"), "text": d.get("text"),
            "cmd": "python " + " ".join(argv[1:])}


def fmt(x) -> str:
    return f"{x:.2f}" if x else "–"


def table(rows: list) -> str:
    out = ["| cap | engine | draft | decode tok/s | tokens per pass | × same engine plain | "
           "× llama.cpp plain | × llama.cpp, same draft | tokens |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = {x["engine"]: x["decode_tps"] for x in rows
                if x["cap"] == r["cap"] and not x["draft"]}
        peer = next((x["decode_tps"] for x in rows if x["cap"] == r["cap"] and
                     x["draft"] == r["draft"] and x["engine"] == "llama.cpp"), None)
        tps = r["decode_tps"]

        def rel(ref):
            return fmt(tps / ref) if tps and ref else "–"
        out.append(f"| {r['cap'] or 'none'} | {r['engine']} | {r['draft']} | "
                   f"{fmt(tps) if not r.get('error') else r['error']} | "
                   f"{fmt(r['per_pass'])} | {rel(base.get(r['engine']))} | "
                   f"{rel(base.get('llama.cpp'))} | {rel(peer)} | {r['n_gen'] or '–'} |")
    return "\n".join(out)


def draft_rows(cache: Path, caps: list, n_gen: int, draft: int, log=lambda m: None) -> list:
    """Per cap (None: uncapped) flashllm and llama.cpp, plain then with drafts; the models in
    the user cache `cache`."""
    prompt = ROOT / "build" / "bench" / "edit-prompt.txt"
    prompt.parent.mkdir(parents=True, exist_ok=True)
    prompt.write_text(edit_prompt())
    rows = []
    for cap in caps:
        for n in (0, draft):
            for make in (flashllm_row, llamacpp_row):
                rows.append(make(cache, prompt, cap, n_gen, n))
                log(f"draft: {rows[-1]['engine']} --draft {n} cap {cap or 'none'}: "
                    f"{fmt(rows[-1]['decode_tps'])} tok/s")
    return rows


def draft_section(rows: list, load: tuple) -> str:
    """The BENCHMARKS.md section of these rows, with the command of each."""
    text = ["## Speculative decoding", "",
            "An editing request whose answer mostly repeats its context (scripts/bench/draft.py: "
            "add type hints to textwrap.dedent, rename a variable; ChatML, greedy, "
            f"{rows[0]['n_gen'] or '–'} tokens, 2 threads), Qwen2.5-Coder-1.5B. flashllm: the "
            "calibrated native model, `--draft 0` and `--draft N` (prompt-lookup guesses, as many "
            "per pass as pay); llama.cpp: the Q4_K_M GGUF, plain and with llama-cpp-python's "
            "LlamaPromptLookupDecoding(N). Uncapped: warm (llama.cpp one warm-up run first); "
            "a cap: "
            "cold page cache under the memory cgroup, llama.cpp's OpenMP threads passive, as in "
            "\"Flash inference\". Decode tok/s counts tokens made after the first, whatever the "
            "number of passes. llama-cpp-python's lookup verifies through logits_all, which keeps "
            "an f32 row of 151936 logits per context token (~600 KB: 0.34 GB for this prompt and "
            "answer) in anonymous memory, which a cap must hold besides the weights' page cache; "
            "where it cannot, the run is OOM-killed (llama.cpp's own C++ `lookup` example has no "
            f"Python binding here). Load average {load[0]} at the start, {load[1]} at the end.", "",
            table(rows), "", "Commands:", ""]
    text += [f"- {r['engine']} --draft {r['draft']}, cap {r['cap'] or 'none'}: `{r['cmd']}`"
             + ("" if r["cap"] is None
                else f" (in `python -m scripts.bench.cgroup_run --cold --limit {r['cap']}`)")
             for r in rows]
    return "\n".join(text) + "\n"


def section(b: Bench):
    """make bench's (title, text, raw rows), or None with --quick."""
    return under_caps(b, "## Speculative decoding",
                      lambda caps: draft_rows(b.args.cache, caps, 128, 8, b.log), draft_section)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--caps", default="none,560MiB")
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--draft", type=int, default=8)
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "bench-draft.json")
    args = ap.parse_args()
    caps = [None if c == "none" else c for c in args.caps.split(",")]
    rows = draft_rows(cache_dir(), caps, args.n_gen, args.draft, lambda m: print(m, file=sys.stderr))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print(portable(draft_section(rows, ("–", "–")), cache_dir(), ROOT))


if __name__ == "__main__":
    main()
