"""Where a decode pass over B streams spends its time, as `flashllm serve` runs it.

Run:  python -m scripts.bench.batch_profile MODEL [--dram-budget 560MiB] [--parallel 4]
                                                 [--ctx-size 512] [-t 2] [--batches 1,4]
                                                 [--rounds 3] [--passes 8]

The model opens as `flashllm serve MODEL --parallel P -c C` opens it (serve/model.open_engine),
each stream prefills its own code prompt, then for --rounds rounds, for each B in --batches in
turn, --passes decode passes carry the next greedy token of streams 0 .. B-1 (alternating the
batch sizes within a round, so a busy machine slows them alike). A pass runs runtime/batch.py's
loop with a clock around each piece: the embedding, each layer's dense weights (a streamed layer
waits for its read here), attention (all B streams), the FFN (its own split from the FFN's
stats: reads waited for, cache bookkeeping, predictor, kernels) and the output head. Prints, per
B, ms per pass for each piece, the pass's device bytes (FFN + dense), and the pass time of
runtime/batch.pass_rows itself (what serve runs; B = 1 takes Model.forward) measured apart,
in wall time and in the process's CPU time (all its threads: what a pass costs whatever else
runs on the machine).
Run it under scripts/bench/cgroup_run.py --limit to profile under a cap.
"""
from __future__ import annotations

import argparse
import inspect
import json
import time
from collections import defaultdict

import numpy as np

from flashllm.runtime.batch import pass_rows

PROMPTS = ["def fibonacci(n):", "def quicksort(items):", "class Stack:\n    def __init__(self):",
           "def is_prime(n):", "def read_csv(path):", "def binary_search(a, x):",
           "def merge_sorted(a, b):", "def word_count(text):"]
clock = time.perf_counter


class Streams:
    """The engine's networks, each with its prompt prefilled: the next token and position."""

    def __init__(self, engine):
        self.nets, self.tok, self.pos = engine.nets, [], []
        for i, net in enumerate(self.nets):
            ids = engine.tok.encode(PROMPTS[i % len(PROMPTS)], add_special=True)
            logits = pass_rows([net], [ids], [0], prefill=True)           # (1, vocab)
            self.tok.append(int(np.argmax(logits[-1])))
            self.pos.append(len(ids))

    def advance(self, b: int, logits: np.ndarray) -> None:
        """Streams 0 .. b-1 take their greedy tokens from logits (b, vocab)."""
        for i in range(b):
            self.tok[i], self.pos[i] = int(np.argmax(logits[i])), self.pos[i] + 1


def bytes_read(base) -> int:
    """Device bytes the FFN and the dense weights have read so far."""
    ffn = sum(t.bytes_read for t in getattr(base.ffn, "rec", None).tokens) \
        if hasattr(base.ffn, "rec") else 0
    return ffn + (base.w.bytes_read if hasattr(base.w, "bytes_read") else 0)


def timed_pass(s: Streams, b: int, ms: dict) -> np.ndarray:
    """runtime/batch.py's pass over streams 0 .. b-1, each piece's seconds added to ms."""
    nets, base = s.nets[:b], s.nets[0]
    tok = np.asarray(s.tok[:b], np.int32)                                 # (b,)
    pos = np.asarray(s.pos[:b], np.int32)                                 # (b,)
    spans = [(net, r, r + 1) for r, net in enumerate(nets)]
    per_stream = len(inspect.signature(base.attention_rows).parameters) == 4
    for net, t, p in zip(nets, tok, pos):
        net.fed[p] = t
    t0 = clock()
    base.ffn.start_pass(b, prefill=False, pos0=int(pos.min()))
    x = base.embed_rows(tok, pos)                                         # (b, d_model)
    t1 = clock()
    ms["embed"] += t1 - t0
    for i in range(base.config.n_layers):
        t0 = clock()
        layer = base.w.layer(i)
        t1 = clock()
        if per_stream:                            # the code before rows shared the products
            for r, net in enumerate(nets):
                net.attention_rows(i, layer, x[r:r + 1], pos[r:r + 1])   # x[r] += attention
        else:
            base.attention_rows(i, layer, x, pos, spans)                  # x (b, d_model) += attn
        t2 = clock()
        base.ffn_rows(i, layer, x)                                        # x (b, d_model) += ffn
        t3 = clock()
        ms["dense layer"] += t1 - t0
        ms["attention"] += t2 - t1
        ms["ffn"] += t3 - t2
    t0 = clock()
    logits = base.output_rows(np.ascontiguousarray(x), pos, tok)          # (b, vocab)
    ms["head"] += clock() - t0
    rec = getattr(base.ffn, "_token", None)
    if rec is not None:
        for name in ("io_s", "mm_s", "predict_s", "compute_s"):
            ms["ffn." + name[:-2]] += getattr(rec, name)
    return logits


def profile(s: Streams, batches: list, rounds: int, passes: int) -> dict:
    """Per B: seconds per piece, pass_rows' own seconds and device bytes, summed over rounds."""
    out = {b: {"ms": defaultdict(float), "pass_rows_s": [], "timed_s": [], "cpu_s": [],
               "bytes": 0, "passes": 0} for b in batches}
    for _ in range(rounds):
        for b in batches:
            o = out[b]
            for _ in range(passes):
                before = bytes_read(s.nets[0])
                t0 = clock()
                logits = timed_pass(s, b, o["ms"])                        # (b, vocab)
                o["timed_s"].append(clock() - t0)
                s.advance(b, logits)
                t0, c0 = clock(), time.process_time()
                logits = pass_rows(s.nets[:b], [[t] for t in s.tok[:b]], s.pos[:b])  # (b, vocab)
                o["pass_rows_s"].append(clock() - t0)
                o["cpu_s"].append(time.process_time() - c0)
                s.advance(b, logits)
                o["bytes"] += bytes_read(s.nets[0]) - before
                o["passes"] += 2
    return out


def report(out: dict) -> list:
    rows = []
    for b, o in out.items():
        n = len(o["timed_s"])
        ms = {k: round(1e3 * v / n, 1) for k, v in sorted(o["ms"].items())}
        timed = 1e3 * float(np.median(o["timed_s"]))
        real = 1e3 * float(np.median(o["pass_rows_s"]))
        cpu = 1e3 * float(np.median(o["cpu_s"]))
        rows.append({"streams": b, "pass_ms_median": round(real, 1),
                     "tok_s": round(1e3 * b / real, 2), "cpu_ms_median": round(cpu, 1),
                     "cpu_tok_s": round(1e3 * b / cpu, 2), "timed_pass_ms_median": round(timed, 1),
                     "pieces_ms_mean": ms, "mib_read_per_pass":
                     round(o["bytes"] / o["passes"] / 2**20, 1),
                     "pass_rows_ms_all": [round(1e3 * t) for t in o["pass_rows_s"]]})
    return rows


def main() -> None:
    from flashllm.cli.app import cache_dir, model_path
    from flashllm.serve.model import EngineSpec, open_engine
    from flashllm.session.options import parse_budget
    from pathlib import Path
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--dram-budget")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--ctx-size", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=8)
    a = ap.parse_args()
    budget = parse_budget(a.dram_budget) if a.dram_budget else None
    path = model_path(a.model, apart=budget is not None)
    spec = EngineSpec(path, a.model, a.parallel, a.ctx_size, a.threads, budget,
                      calibrate="" if Path(a.model).is_dir() else a.model)
    engine = open_engine(spec, cache_dir(), print)
    try:
        streams = Streams(engine)
        batches = [int(b) for b in a.batches.split(",")]
        for row in report(profile(streams, batches, a.rounds, a.passes)):
            print(json.dumps(row), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
