"""Mixture-of-experts decode, flashllm against llama.cpp, under memory caps of 1/2 and 1/4 of the file.

flashllm streams the routed experts from flash, llama.cpp maps the GGUF; each runs in a cgroup
capped at 1/2 and 1/4 of the GGUF's size, from a cold page cache (the page cache is dropped
before every run: root, cgroup v1), in the same run.

Run:  python -m scripts.bench.moe [--n-gen 16] [--caps 1/2,1/4] [--kinds q4_0,q4_k_m]
          [--dtypes native] [--build build/moe]
      (root, cgroup v1; else the capped rows are skipped with the reason)

The models are scripts/fixtures/make_moe_gguf.py's random-weight GGUFs in OLMoE-1B-7B's shape
(16 layers, 64 experts, top-8, d_model 2048, expert n_ff 1024): `q4_0` (every matrix Q4_0, 3.63
GiB) and `q4_k_m` (llama.cpp's Q4_K_M mix: Q4_K gate / up, Q6_K / Q4_K down by layer), made
into --build when absent and converted there by the default conversion (`flashllm convert X.gguf`,
what `run X.gguf` does: native, each expert the GGUF's own rows, docs/FORMAT.md); --dtypes
native,q4_0 adds a `--dtype q4_0` conversion's rows. Routing is near-uniform (the
residual stream carries the token; scripts/bench/moe_routing.py measures it): the worst case for
flashllm's expert cache (real text is skewed). Per cap: llama.cpp through
scripts/bench/llamacpp.py (64 fixed token ids, --n-gen tokens, file-backed weights, OpenMP
passive; it feeds varying token ids), flashllm `run` on a 64-byte prompt with --dram-budget =
the cap, sampling at temperature 1 (greedy decoding of random weights repeats one token, and with
it the same experts: a best case, not the one measured), --stats --json. Rows:
decode tok/s, flashllm × llama.cpp, cgroup peak, bytes read per token against the routed experts'
bytes, the read-ahead's figures. Raw results: BUILD/results.json. `make bench`'s "Mixture of
experts under a cap" section is collect() and row() (moe_caps.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from fractions import Fraction
from pathlib import Path

from flashllm.convert import native
from flashllm.format.layout import NATIVE, layer_strides
from scripts.bench.flashllm_cli import ROOT, Flashllm, run_cmd
from scripts.fixtures.make_moe_gguf import write as write_gguf

BUILD = ROOT / "build" / "moe"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fi"   # 64 bytes


def last_json(text: str) -> dict:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return {}


def active_bytes(model: Path) -> int:
    """Bytes of the experts a token is routed to: Σ over layers of top-k × n_ff × its stride."""
    man = json.loads((model / "manifest.json").read_text())
    c = man["config"]
    return c["n_experts_used"] * c["n_ff"] * sum(layer_strides(man["ffn"]))


def converted(fl: Flashllm, gguf: Path, model: Path, dtype: str) -> Path:
    """model, the conversion of gguf in dtype ("native": the default, no --dtype), made when
    absent or an older recipe (native.outdated)."""
    man = model / "manifest.json"
    if man.is_file() and native.outdated(json.loads(man.read_text())) is None:
        return model
    extra = [] if dtype == NATIVE else ["--dtype", dtype]
    r = run_cmd(fl.argv + ["convert", str(gguf), "-o", str(model), "--force"] + extra, None,
                cold=False, timeout=7200)
    if r.get("rc") != 0:
        raise RuntimeError(f"converting {gguf} failed: {(r.get('stderr') or r.get('error'))[-400:]}")
    return model


def llamacpp(gguf: Path, cap: int, n_gen: int) -> dict:
    argv = [sys.executable, "-m", "scripts.bench.llamacpp", "--model", str(gguf), "--threads", "2",
            "--reps", "1", "--n-gen", str(n_gen), "--no-warmup", "--omp-wait-policy", "passive",
            "--json"]
    r = run_cmd(argv, cap, cold=True, timeout=3600)
    out = last_json(r.get("stdout") or "")
    return {"cmd": argv, "rc": r.get("rc"), "error": r.get("error") or (r.get("stderr") or "")[-400:]
            if not out else None, "decode_tps": out.get("decode_tps"), "peak": r.get("peak"),
            "failcnt": r.get("failcnt")}


def flashllm(fl: Flashllm, model: Path, prompt: Path, cap: int, n_gen: int) -> dict:
    argv = fl.argv + ["run", str(model), "-f", str(prompt), "-n", str(n_gen), "-t", "2", "-c", "128",
                      "--temp", "1", "--seed", "1", "--dram-budget", str(cap), "--stats", "--json"]
    r = run_cmd(argv, cap, cold=True, timeout=3600)
    out = last_json(r.get("stderr") or "")
    s = (out.get("flash") or {}).get("summary") or {}
    return {"cmd": argv, "shown": fl.show(argv), "rc": r.get("rc"),
            "error": None if out else (r.get("error") or (r.get("stderr") or "")[-400:]),
            "decode_tps": out.get("decode_tps"), "peak": r.get("peak"), "failcnt": r.get("failcnt"),
            "summary": s, "plan": ((out.get("flash") or {}).get("plan") or {}).get("summary")}


def outcome(r: dict) -> str:
    """A row's decode tok/s, else the last line of why it has none (one table cell)."""
    if r.get("decode_tps"):
        return f"{r['decode_tps']:.2f}"
    why = (r.get("error") or "").strip().splitlines()[-1:] or [f"exit {r.get('rc')}"]
    return why[0].replace("|", "/")[:100]


def row(label: str, cap_name: str, cap: int, ll: dict, fl: dict, active: int) -> str:
    mib = lambda n: "–" if n is None else f"{n / 2**20:.0f}"               # noqa: E731
    s, ratio = fl["summary"], "–"
    if fl["decode_tps"] and ll["decode_tps"]:
        ratio = f"{fl['decode_tps'] / ll['decode_tps']:.1f}"
    head = (f"| {label} | {cap_name} ({mib(cap)} MiB) | {outcome(ll)} | {outcome(fl)} | {ratio} | "
            f"{mib(ll['peak'])} / {mib(fl['peak'])} |")
    per_tok = s.get("io_bytes_per_token")
    if per_tok is None:
        return head + " – | – | – |"
    pf = s.get("prefetch_hit_rate")
    return (f"{head} {mib(per_tok)} / {mib(active)} = {per_tok / active:.2f} | "
            f"{s.get('experts_cached_per_token', 0):.1f} / {s.get('experts_read_per_token', 0):.1f} / "
            f"{s.get('experts_prefetched_per_token', 0):.1f} | "
            f"{'–' if pf is None else f'{pf:.0%}'} / {s.get('guess_recall') or 0:.0%} |")


HEADER = ["| GGUF, conversion | cap | llama.cpp tok/s | flashllm tok/s | × llama.cpp | peak MiB "
          "(llama.cpp / flashllm) | MiB read per token / routed experts' MiB | experts per token "
          "cached / read / prefetched | prefetch used / guess recall |",
          "|---|---|---:|---:|---:|---|---|---|---|"]


def label(kind: str, dtype: str) -> str:
    return f"{kind.upper()}, " + ("default (native)" if dtype == NATIVE else f"--dtype {dtype}")


def collect(fl: Flashllm, build: Path, kinds: list, dtypes: list, caps: list, n_gen: int,
            log=print) -> list:
    """Per fixture kind (made into build when absent, converted there per dtype) and cap (a
    fraction of the GGUF's size, as text): llama.cpp once, then flashllm per conversion; one
    result each (log gets its table row as it comes)."""
    prompt = build / "prompt.txt"
    build.mkdir(parents=True, exist_ok=True)
    prompt.write_text(PROMPT, encoding="utf-8")
    results = []
    for kind in kinds:
        gguf = build / f"olmoe-shape-{kind}.gguf"
        if not gguf.is_file():
            write_gguf(gguf, kind)
        models = {dt: converted(fl, gguf, build / f"olmoe-{kind}-{dt}", dt) for dt in dtypes}
        size = gguf.stat().st_size
        for text in caps:
            cap = int(size * Fraction(text))
            ll = llamacpp(gguf, cap, n_gen)
            for dt, model in models.items():
                fr = flashllm(fl, model, prompt, cap, n_gen)
                results.append({"gguf": kind, "dtype": dt, "cap": text, "cap_bytes": cap,
                                "model": str(model), "active": active_bytes(model),
                                "llama.cpp": ll, "flashllm": fr})
                log(row(label(kind, dt), text, cap, ll, fr, results[-1]["active"]))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", type=Path, default=BUILD, help="where the fixtures and conversions live")
    ap.add_argument("--kinds", default="q4_0,q4_k_m", help="fixtures (make_moe_gguf --type)")
    ap.add_argument("--dtypes", default=NATIVE, help="conversions: native (the default) and any --dtype")
    ap.add_argument("--n-gen", type=int, default=16)
    ap.add_argument("--caps", default="1/2,1/4", help="fractions of the GGUF's size")
    args = ap.parse_args()
    print("\n".join(HEADER))
    try:
        results = collect(Flashllm.find(sys.executable), args.build, args.kinds.split(","),
                          args.dtypes.split(","), args.caps.split(","), args.n_gen,
                          lambda line: print(line, flush=True))
    except RuntimeError as e:                   # a conversion that failed
        sys.exit(f"moe: {e}")
    (args.build / "results.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
