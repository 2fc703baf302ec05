"""`flashllm serve` under concurrent streaming clients: aggregate and per-stream decode tok/s,
time to first token (p50 / p95), the streams a decode pass carried, the server's peak RSS.

Run:  python -m scripts.bench.serve MODEL [--dram-budget 560MiB] [--cap 560MiB] [--clients 1,4]
                                          [--tokens 64] [--parallel 4] [--ctx-size 512] [-t 2]

The server starts in a subprocess on a free loopback port (as `flashllm serve MODEL --parallel
P`), answers one warm-up request, then for each K in --clients, K openai-client streams start
at once, each a different code prompt completed greedily for --tokens tokens. Aggregate tok/s:
all tokens made / the round's wall time; decode tok/s: the tokens after each stream's first /
(the last token of any stream - the first token of any), and per stream its own (last - first). --cap: the server runs
under a cgroup-v1 memory cap (scripts/bench/cgroup_run.py, root), whose peak (anonymous memory
and page cache) and failcnt are printed once the server has stopped.
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

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["def fibonacci(n):", "def quicksort(items):", "class Stack:\n    def __init__(self):",
           "def is_prime(n):", "def read_csv(path):", "def binary_search(a, x):",
           "def merge_sorted(a, b):", "def word_count(text):"]


def start_server(model: str, args: list, cap=None) -> tuple:
    """(the process, with its log's path as .log; the server's url); with cap, the process is
    cgroup_run's (its child serves)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(Path(tempfile.gettempdir()) / f"bench-serve-{port}.log", "w")
    cmd = [sys.executable, "-m", "flashllm", "serve", model, "--port", str(port), *args]
    if cap:
        cmd = [sys.executable, "-m", "scripts.bench.cgroup_run", "--limit", cap, "--json",
               "--", *cmd]
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


def round_of(url: str, k: int, tokens: int) -> dict:
    import httpx
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    model = client.models.list().data[0].id
    before = httpx.get(url + "/health").json()
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
    ttft = sorted(s["first"] - s["start"] for s in out)
    if len(out) < k:
        sys.exit(f"{k - len(out)} of {k} streams failed")
    per = [(s["tokens"] - 1) / (s["end"] - s["first"]) for s in out if s["end"] > s["first"]]
    passes = after["decode_passes"] - before["decode_passes"]
    return {"clients": k, "tokens": sum(s["tokens"] for s in out), "wall_s": round(wall, 2),
            "aggregate_tps": round(sum(s["tokens"] for s in out) / wall, 2),
            "aggregate_decode_tps": round(sum(s["tokens"] - 1 for s in out) / (
                max(s["end"] for s in out) - min(s["first"] for s in out)), 2),
            "per_stream_decode_tps": round(sum(per) / len(per), 2),
            "ttft_p50_s": round(ttft[len(ttft) // 2], 2),
            "ttft_p95_s": round(ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))], 2),
            "streams_per_pass": round((after["decode_rows"] - before["decode_rows"])
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


def stop(proc, pid: int, cap) -> None:
    """SIGTERM the server; under a cap, print cgroup_run's peak and failcnt."""
    os.kill(pid, signal.SIGTERM)
    proc.wait(120)
    if cap:
        res = json.loads(Path(proc.log).read_text().strip().splitlines()[-1])
        print(json.dumps({"cap": cap, "peak_mib": round(res["peak_bytes"] / 2**20, 1),
                          "failcnt": res["failcnt"], "oom_kills": res["oom_kills"],
                          "returncode": res["returncode"]}), flush=True)


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
    a = ap.parse_args()
    args = ["--parallel", str(a.parallel), "-c", str(a.ctx_size), "-t", str(a.threads),
            "--queue-size", "64"] + (["--dram-budget", a.dram_budget] if a.dram_budget else [])
    proc, url = start_server(a.model, args, a.cap)
    pid = server_pid(proc, a.cap)
    try:
        round_of(url, 1, 8)                                   # warm-up
        for k in (int(c) for c in a.clients.split(",")):
            row = round_of(url, k, a.tokens)
            row.update(budget=a.dram_budget or "none", peak_rss_mib=peak_rss(pid) >> 20)
            print(json.dumps(row), flush=True)
    finally:
        stop(proc, pid, a.cap)


if __name__ == "__main__":
    main()
