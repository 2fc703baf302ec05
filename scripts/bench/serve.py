"""`flashllm serve` under concurrent streaming clients: aggregate and per-stream decode tok/s,
time to first token (p50 / p95), the streams a decode pass carried, device bytes read per token
made, the server's peak memory.

Run:  python -m scripts.bench.serve MODEL [--dram-budget 560MiB] [--cap 560MiB] [--clients 1,4]
                                          [--tokens 64] [--parallel 4] [--ctx-size 512] [-t 2]
                                          [--draft N] [--draft-kind lookup|self]

The server starts in a subprocess on a free loopback port (as `flashllm serve MODEL --parallel
P`), answers one warm-up request, then for each K in --clients (a list: 1,4,1,4 alternates), K
openai-client streams start at once, each a different code prompt completed greedily for
--tokens tokens. Aggregate tok/s: all tokens made / the round's wall time; decode tok/s: the
tokens after each stream's first / (the last token of any stream - the first token of any), and
per stream its own (last - first). Draft guesses checked and kept, and tokens a pass made
(/health). MiB a token: the server's device reads in the round
(/proc/PID/io read_bytes: direct I/O included) / the tokens made. --cap: the server runs under a
cgroup-v1 memory cap (scripts/bench/cgroup_run.py, root), whose peak (anonymous memory and page
cache) and failcnt are printed once the server has stopped.
`make bench`'s "Serving" section (bench.py --sections serve) is serve_rows + serve_section.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import tempfile
import sys
import threading
import time
from pathlib import Path

from scripts.bench.harness import Bench, under_caps

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["def fibonacci(n):", "def quicksort(items):", "class Stack:\n    def __init__(self):",
           "def is_prime(n):", "def read_csv(path):", "def binary_search(a, x):",
           "def merge_sorted(a, b):", "def word_count(text):"]


def start_server(model: str, args: list, cap=None, cold: bool = False) -> tuple:
    """(the process, with its log's path as .log; the server's url); with cap, the process is
    cgroup_run's (its child serves; cold: from a dropped page cache)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(Path(tempfile.gettempdir()) / f"bench-serve-{port}.log", "w")
    cmd = [sys.executable, "-m", "flashllm", "serve", model, "--port", str(port), *args]
    if cap:
        cmd = [sys.executable, "-m", "scripts.bench.cgroup_run", "--limit", cap, "--json",
               *(["--cold"] if cold else []), "--", *cmd]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    proc.log = log.name
    url = f"http://127.0.0.1:{port}"
    import httpx
    deadline = time.monotonic() + 3600        # a first run converts and calibrates the model
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"serve exited with {proc.returncode}: see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    sys.exit(f"serve did not start in an hour: see {log.name}")


def one_stream(client, model: str, prompt: str, tokens: int, out: list) -> None:
    t0 = time.perf_counter()
    stamps = []
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=tokens,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    n = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    out.append({"start": t0, "first": stamps[0], "end": stamps[-1], "tokens": n})


def read_bytes(pid: int) -> int:
    """Bytes the process (all its threads) had the device read: /proc/PID/io read_bytes."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def round_of(url: str, k: int, tokens: int, pid: int) -> dict:
    import httpx
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    model = client.models.list().data[0].id
    before = httpx.get(url + "/health").json()
    io0 = read_bytes(pid)
    out: list = []
    threads = [threading.Thread(target=one_stream, args=(client, model, PROMPTS[i % len(PROMPTS)],
                                                         tokens, out)) for i in range(k)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = httpx.get(url + "/health").json()
    io = read_bytes(pid) - io0
    ttft = sorted(s["first"] - s["start"] for s in out)
    if len(out) < k:
        sys.exit(f"{k - len(out)} of {k} streams failed")
    per = [(s["tokens"] - 1) / (s["end"] - s["first"]) for s in out if s["end"] > s["first"]]
    passes = after["decode_passes"] - before["decode_passes"]
    proposed, accepted = (after.get(k, 0) - before.get(k, 0)
                          for k in ("draft_proposed", "draft_accepted"))
    return {"clients": k, "tokens": sum(s["tokens"] for s in out), "wall_s": round(wall, 2),
            "aggregate_tps": round(sum(s["tokens"] for s in out) / wall, 2),
            "aggregate_decode_tps": round(sum(s["tokens"] - 1 for s in out) / (
                max(s["end"] for s in out) - min(s["first"] for s in out)), 2),
            "per_stream_decode_tps": round(sum(per) / len(per), 2),
            "ttft_p50_s": round(ttft[len(ttft) // 2], 2),
            "ttft_p95_s": round(ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))], 2),
            "streams_per_pass": round((after["decode_rows"] - before["decode_rows"])
                                      / max(1, passes), 2),
            "mib_read_per_token": round(io / 2**20 / max(1, sum(s["tokens"] for s in out)), 1),
            "draft_proposed": proposed, "draft_accepted": accepted,
            "tokens_per_pass": round((after["decode_rows"] - before["decode_rows"] + accepted)
                                     / max(1, passes), 2)}


def server_pid(proc, cap) -> int:
    """The serving process: proc, or under a cap cgroup_run's child."""
    if not cap:
        return proc.pid
    out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    return int(out.stdout.split()[0])


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    return 0


def stop(proc, pid: int, cap) -> dict:
    """SIGTERM the server; under a cap, cgroup_run's peak and failcnt ({} uncapped)."""
    os.kill(pid, signal.SIGTERM)
    proc.wait(120)
    if not cap:
        return {}
    res = json.loads(Path(proc.log).read_text().strip().splitlines()[-1])
    return {"cap": cap, "peak_mib": round(res["peak_bytes"] / 2**20, 1),
            "failcnt": res["failcnt"], "oom_kills": res["oom_kills"],
            "returncode": res["returncode"]}


def measure(model: str, args: list, cap, clients: list, tokens: int, cold: bool = False,
            log=lambda m: None) -> tuple:
    """([a row per round of clients], the cap's outcome) of one server's life."""
    proc, url = start_server(model, args, cap, cold)
    pid = server_pid(proc, cap)
    rows = []
    try:
        round_of(url, 1, 8, pid)                              # warm-up
        for k in clients:
            rows.append({**round_of(url, k, tokens, pid), "peak_rss_mib": peak_rss(pid) >> 20})
            log(json.dumps(rows[-1]))
    finally:
        outcome = stop(proc, pid, cap)
    return rows, outcome


MODEL = Path("converted") / "qwen2.5-coder-1.5b-native-cal"    # in the user cache: bench.py's
SECTION_CLIENTS = [1, 2, 4, 8]
SECTION_SERVER = dict(parallel=4, ctx=256, threads=2)    # 8 clients: 4 served, 4 queued


def serve_rows(cache: Path, caps: list, tokens: int = 64, log=lambda m: None) -> list:
    """Per cap (None: uncapped; else the server's --dram-budget and its cgroup cap, from a cold
    page cache) one server's rounds of SECTION_CLIENTS clients: [{cap, cmd, rows, outcome}]."""
    out = []
    for cap in caps:
        args = server_args(budget=cap, **SECTION_SERVER)
        cmd = " ".join(["flashllm serve", str(cache / MODEL), *args])
        try:
            rows, outcome = measure(str(cache / MODEL), args, cap, SECTION_CLIENTS, tokens,
                                    cold=cap is not None, log=log)
            out.append({"cap": cap, "cmd": cmd, "rows": rows, "outcome": outcome})
        except (SystemExit, OSError, RuntimeError) as e:     # a server that did not start
            out.append({"cap": cap, "cmd": cmd, "rows": [], "outcome": {}, "error": str(e)})
    return out


def serve_table(runs: list) -> list:
    out = ["| cap | clients | aggregate tok/s | aggregate decode tok/s | × 1 client | per-stream "
           "decode tok/s | TTFT p50 / p95 (s) | streams a pass | guesses kept | MiB read a token "
           "| peak MiB |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        cap = run["cap"] or "none"
        if run.get("error"):
            out.append(f"| {cap} | – | {run['error'][:100]} | | | | | | | | |")
            continue
        one = next((r["aggregate_decode_tps"] for r in run["rows"] if r["clients"] == 1), None)
        peak = run["outcome"].get("peak_mib")
        for r in run["rows"]:
            ratio = f"{r['aggregate_decode_tps'] / one:.2f}" if one else "–"
            out.append(f"| {cap} | {r['clients']} | {r['aggregate_tps']:.2f} | "
                       f"{r['aggregate_decode_tps']:.2f} | {ratio} | "
                       f"{r['per_stream_decode_tps']:.2f} | {r['ttft_p50_s']:.2f} / "
                       f"{r['ttft_p95_s']:.2f} | {r['streams_per_pass']:.2f} | "
                       f"{kept(r)} | {r['mib_read_per_token']:.1f} | "
                       f"{'' if peak is None else f'{peak} / '}{r['peak_rss_mib']} |")
    return out


def kept(row: dict) -> str:
    """A round's draft guesses kept of those checked (/health's draft_accepted /
    draft_proposed), or – without drafting."""
    n = row.get("draft_proposed", 0)
    return f"{row['draft_accepted']} / {n} ({100 * row['draft_accepted'] / n:.0f}%)" if n else "–"


def serve_section(runs: list, load: tuple) -> str:
    """The BENCHMARKS.md "## Serving" section of serve_rows' runs, with each server's command."""
    srv = SECTION_SERVER
    text = ["## Serving", "",
            "`flashllm serve` on Qwen2.5-Coder-1.5B (the calibrated native model), "
            f"`--parallel {srv['parallel']} -c {srv['ctx']} -t {srv['threads']}`; "
            "scripts/bench/serve.py: after one warm-up request, rounds of 1, 2, 4 and 8 "
            "concurrent streaming clients (the `openai` client, one thread each), each a "
            "different short code prompt completed greedily for 64 tokens; 8 clients: 4 served, "
            "4 queued until a stream frees. Aggregate tok/s: the tokens of all clients / the "
            "round's wall time; aggregate decode tok/s: the tokens after each stream's first / "
            "(the last token of any stream - the first of any), and × 1 client its ratio to the "
            "1-client round; per-stream: each stream's own (tokens - 1) / (last - first), "
            "averaged; TTFT from the request to its first text; streams a pass: the rows a "
            "decode pass carried (/health); guesses kept: the draft guesses the passes kept of "
            "those they checked (/health; the server drafts as `run` does, --draft); MiB read a "
            "token: the server's device reads in the "
            "round (/proc/PID/io read_bytes) / the tokens made. A cap: `--dram-budget CAP` and "
            "the server in a memory cgroup of CAP from a cold page cache "
            "(scripts/bench/cgroup_run.py); peak MiB: the group's peak over the server's life "
            "(anonymous memory and page cache, which the files' buffered reads fill up to the "
            "cap and the cap reclaims: failcnt), then the process's peak RSS (VmHWM) so far. "
            f"Load average {load[0]} at the start, {load[1]} at the end.", ""]
    text += serve_table(runs)
    text += ["", "Commands (from the repository root; a cap's server in "
             "`python -m scripts.bench.cgroup_run --cold --limit CAP --json --`):", ""]
    for run in runs:
        o = run["outcome"]
        tail = f"; peak {o['peak_mib']} MiB, failcnt {o['failcnt']}, OOM kills " \
               f"{o['oom_kills']}" if o else ""
        text.append(f"- cap {run['cap'] or 'none'}: `{run['cmd']}`{tail}")
    return "\n".join(text) + "\n"


def server_args(parallel: int, ctx: int, threads: int, budget=None) -> list:
    return ["--parallel", str(parallel), "-c", str(ctx), "-t", str(threads), "--queue-size",
            "64"] + (["--dram-budget", budget] if budget else [])


def section(b: Bench):
    """make bench's (title, text, raw runs), or None with --quick."""
    return under_caps(b, "## Serving", lambda caps: serve_rows(b.args.cache, caps, 64, b.log),
                      serve_section)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--dram-budget")
    ap.add_argument("--cap", help="a cgroup memory cap for the server, e.g. 560MiB (root)")
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--ctx-size", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--draft", help="the server's --draft (default: its own, as `run`'s)")
    ap.add_argument("--draft-kind", help="the server's --draft-kind")
    a = ap.parse_args()
    args = server_args(a.parallel, a.ctx_size, a.threads, a.dram_budget) + \
        (["--draft", a.draft] if a.draft else []) + \
        (["--draft-kind", a.draft_kind] if a.draft_kind else [])
    rows, outcome = measure(a.model, args, a.cap, [int(c) for c in a.clients.split(",")],
                            a.tokens, log=lambda m: print(m, flush=True))
    if outcome:
        print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
