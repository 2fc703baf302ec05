"""flashllm as a benchmark contender: the CLI invocation, conversions, a fixed-length prompt and
the parsing of `flashllm run`'s timings (--json when the CLI has it, else the timings lines).

Used by bench.py; every figure comes from a `flashllm run` subprocess, so the command in
BENCHMARKS.md is the one a user can type.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from scripts.bench.cgroup_run import CgroupUnavailable, run_capped
from flashllm.session.calibration import MAX_PPL_COST

ROOT = Path(__file__).resolve().parents[2]    # the repository: every command runs from here
TIMING = re.compile(r"(prompt eval|eval) time\s*=\s*([0-9.]+) ms /\s*(\d+) (?:tokens|runs)")
# the options of `flashllm run` a benchmark row may need
RUN_OPTIONS = ("--json", "--stats", "--dram-budget", "--naive", "--dense", "--window",
               "--sparse-head", "--draft-kind", "--ignore-eos")


@dataclass
class Flashllm:
    """How to call the flashllm CLI here: argv prefix for subprocesses and its display name."""
    argv: List[str]
    shown: str = "flashllm"
    fixed_length: bool = False     # run --ignore-eos: -n tokens, as llama.cpp's rows decode

    @classmethod
    def find(cls, python: str) -> "Flashllm":
        """The console script next to python if installed, else the module through python -c."""
        script = Path(python).parent / "flashllm"
        if script.is_file():
            return cls([str(script)])
        if shutil.which("flashllm"):
            return cls(["flashllm"])
        return cls([python, "-c", "import sys; sys.argv[0] = 'flashllm'; "
                                  "from flashllm.cli.app import main; main()"])

    def options(self) -> Dict[str, bool]:
        """Which of RUN_OPTIONS `flashllm run --help` lists."""
        res = subprocess.run(self.argv + ["run", "--help"], capture_output=True, text=True,
                             cwd=ROOT, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
        text = res.stdout + res.stderr
        return {opt: re.search(re.escape(opt) + r"(?![-\w])", text) is not None for opt in RUN_OPTIONS}

    def run_argv(self, model: Path, prompt_file: Path, n_gen: int, threads: int,
                 extra: Sequence[str] = (), as_json: bool = False) -> List[str]:
        ctx = 64 * ((n_tokens_max(n_gen) + 63) // 64)  # KV cache sized like llama.cpp's n_ctx
        tail = ["run", str(model), "-f", str(prompt_file), "-n", str(n_gen), "-t", str(threads),
                "-c", str(ctx), "--temp", "0", *(["--ignore-eos"] if self.fixed_length else []),
                *extra]
        return self.argv + tail + (["--json"] if as_json else [])

    def show(self, argv: Sequence[str]) -> str:
        """argv as a user would type it (the console script name instead of python -c ...)."""
        rest = list(argv[len(self.argv):])
        return " ".join([self.shown] + [_quote(a) for a in rest])


def n_tokens_max(n_gen: int, n_prompt: int = 64) -> int:
    return n_prompt + n_gen + 8


def _quote(arg: str) -> str:
    return arg if re.fullmatch(r"[\w./:=%+-]+", arg) else "'" + arg.replace("'", "'\\''") + "'"


def converted_dir(cache: Path, name: str, dtype: str) -> Path:
    """Where the registry keeps NAME converted at DTYPE (flashllm.convert.resolve.resolve_model)."""
    return cache / "converted" / f"{name}-{dtype}"


def convert_argv(fl: Flashllm, gguf: Path, out: Path, dtype: str) -> List[str]:
    return fl.argv + ["convert", str(gguf), "-o", str(out), "--dtype", dtype]


def ensure_converted(fl: Flashllm, gguf: Path, out: Path, dtype: str, log) -> str:
    """Convert gguf to out at dtype unless done already (by this flashllm's recipe:
    native.outdated, nor the one before it: native.coarser); the command, for the report."""
    from flashllm.convert.resolve import conversion_outdated
    argv = convert_argv(fl, gguf, out, dtype)
    done = (out / "manifest.json").is_file()
    why = done and (conversion_outdated(out) or conversion_outdated(out, coarser=True))
    if not done or why:
        log(f"converting {gguf.name} -> {out} ({dtype})" + (f": again, {why}" if why else ""))
        res = subprocess.run(argv + ["--force"] * bool(why), capture_output=True, text=True,
                             cwd=ROOT)
        if res.returncode != 0:
            raise RuntimeError(f"convert failed: {res.stderr.strip()[-400:]}")
    return fl.show(argv)


def ensure_calibrated(fl: Flashllm, src: Path, log) -> tuple[Path, str]:
    """(src + "-cal", the command): a copy of the converted model run through `flashllm
    calibrate` with its defaults (thresholds, hot-first order, predictor), done once, again
    when the bundles or the default cost bound have changed since."""
    out = src.with_name(src.name + "-cal")
    argv = fl.argv + ["calibrate", str(out)]
    if not _calibrated_as_today(out, src):
        log(f"calibrating {out}")
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(src, out)
        res = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
        if res.returncode != 0:
            raise RuntimeError(f"calibrate failed: {res.stderr.strip()[-400:]}")
        (out / ".calibrated").write_text(res.stderr[-4000:], encoding="utf-8")
    return out, f"cp -r {src} {out} && " + fl.show(argv)


def _calibrated_as_today(out: Path, src: Path) -> bool:
    """Whether the copy out was calibrated from src's bundles by today's defaults: hot-first
    order, a sparse head, the target checked on each text within today's bound (issue 50)."""
    if not (out / ".calibrated").is_file() or _bundles(out) != _bundles(src):
        return False
    sp = _sparsity(out)
    if any(sp.get(k) is None for k in ("order_by", "head", "quality")):
        return False
    return "checked" in sp["quality"] and sp["quality"].get("bound") == MAX_PPL_COST


def _sparsity(model: Path) -> dict:
    """A calibrated copy's sparsity section: its order_by (the hot-first key; None when
    calibrated before session 15, by frequency whatever the model) and head (what a sparse head
    reads; None before session 17)."""
    man = json.loads((model / "manifest.json").read_text(encoding="utf-8"))
    return man.get("sparsity") or {}


def _bundles(model: Path) -> tuple:
    """What a model's bundles are (dtypes, strides per layer): a calibrated copy of an older
    conversion of src differs from src there."""
    f = json.loads((model / "manifest.json").read_text(encoding="utf-8"))["ffn"]
    return (f["dtype"], f.get("down_dtype"), f["stride"],
            [(e.get("stride"), e.get("down_dtype")) for e in f["layers"]])


def prompt_text(kind: str) -> str:
    """Real text present on every machine that no calibration saw: the opening of the evaluation
    split (sparsity/corpus.py), stdlib source (heapq.py first) or pydoc topics ("assignment")."""
    from flashllm.sparsity.corpus import builtin_text
    return builtin_text("evaluation", kind, max_chars=40000).text


def make_prompt(model: Path, n_tokens: int, kind: str, out: Path) -> int:
    """Write a prefix of prompt_text(kind) that the model's tokenizer encodes (with its special
    tokens) to exactly n_tokens ids, or the nearest count below; returns that count."""
    from flashllm.format.reader import open_flash
    from flashllm.generation.tokenizer import Tokenizer
    tok = Tokenizer.from_flash(open_flash(model))
    text = prompt_text(kind)
    ids = tok.encode(text, add_special=False)
    n_special = len(tok.encode(text[:200], add_special=True)) - len(tok.encode(text[:200], add_special=False))
    best, best_n = "", 0
    for k in range(n_tokens - n_special + 3, 0, -1):
        cand = tok.decode(ids[:k])
        n = len(tok.encode(cand, add_special=True))
        if n <= n_tokens and n > best_n:
            best, best_n = cand, n
        if n == n_tokens:
            break
    out.write_text(best, encoding="utf-8")
    return best_n


def parse_run(stderr: str) -> Optional[dict]:
    """The run's figures: the last JSON object on stderr (`--json`), else the timings lines.
    Keys at least: n_prompt, prefill_s, n_decode, decode_s, prefill_tps, decode_tps."""
    for line in reversed(stderr.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if isinstance(data, dict) and ("decode_tps" in data or "decode_s" in data):
                return _with_rates(data)
    found = {}
    for label, ms, n in TIMING.findall(stderr):
        key = "prefill" if label == "prompt eval" else "decode"
        found[f"{key}_s"] = float(ms) / 1e3
        found["n_prompt" if key == "prefill" else "n_decode"] = int(n)
    if "decode_s" not in found or "prefill_s" not in found:
        return None
    return _with_rates(found)


def _with_rates(d: dict) -> dict:
    d = dict(d)
    if "prefill_tps" not in d and d.get("prefill_s"):
        d["prefill_tps"] = d["n_prompt"] / d["prefill_s"]
    if "decode_tps" not in d and d.get("decode_s"):
        d["decode_tps"] = d["n_decode"] / d["decode_s"]
    return d


def run_cmd(argv: List[str], cap: Optional[int], cold: bool, timeout: float) -> dict:
    """argv in a memory cgroup when possible (peak, failcnt), else plainly; the raw outcome."""
    try:
        r = run_capped(argv, cap, cold=cold, timeout=timeout, cwd=str(ROOT))
        return {"rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr, "peak": r.peak_bytes,
                "failcnt": r.failcnt, "oom": r.oom_kills, "wall": r.wall_s}
    except CgroupUnavailable as e:
        if cap is not None:
            return {"rc": None, "error": f"skipped: {e}"}
        p = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
        return {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
