"""Where a decode token's time goes, per op, in process (the model fully in DRAM).

Run:  python -m scripts.bench.decode_profile MODEL [--tokens 64] [--threads 2] [--prompt FILE]
MODEL: a converted folder (or a models.toml name already converted in the user cache).

Loads the model as `flashllm run MODEL` does without a budget (every weight resident, f16 KV
cache), prefills a prompt, then decodes --tokens tokens greedily while every call into the
compute kernel (flashllm/ffi/kernel.py) is timed and charged to an op: the attention's q / k / v
(or fused qkv: runtime/layer.py) / o matmuls, attention itself, the FFN (its gate+up and down
matmuls and activation when it multiplies rows, else its bundles), the output head, norms,
RoPE, embeddings; a decode token's one-call attention and FFN blocks (ffi/block.py) and a mixture
of experts' layer (its router's matmul, the routing, fl_moe_ffn; a decode token's one-call
layer, fl_moe_token, "moe block") are ops of their own. What the decode loop spends outside
those calls is "python" (numpy adds, KV cache writes, the loop, sampling's argmax). Prints ms
per token per op and tok/s, and the process's CPU time per token (with one thread, what a token
costs whatever else runs: a loaded machine stretches the wall time, not this); --json one JSON
object.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from flashllm.ffi import block, kernel, moe as moe_kernel
from flashllm.format.reader import open_flash
from flashllm.generation.tokenizer import Tokenizer
from flashllm.runtime.ffn import DenseFfn
from flashllm.runtime.model import Model
from flashllm.runtime.moe import Routers

WRAPPED = ("matmul", "ffn_bundles", "attention", "rmsnorm", "layernorm", "rope", "get_rows",
           "act_mul")
CALLS = ((block.AttnToken, "__call__", "attn block"), (block.FfnToken, "__call__", "ffn block"),
         (moe_kernel.ExpertSet, "__call__", "moe experts"), (Routers, "route", "moe route"),
         (moe_kernel.MoeToken, "__call__", "moe block"))


class Timers:
    """Seconds per op, charged by wrappers around the kernel functions the model calls."""

    def __init__(self, cfg, clock=time.perf_counter):
        self.clock = clock      # perf_counter (wall), or thread_time (CPU: --threads 1 only)
        self.s = defaultdict(float)
        self.n = defaultdict(int)
        self.cfg = cfg
        self.on = False
        self.in_ffn = False     # inside DenseFfn.__call__: its matmuls are the FFN's

    def op_of(self, name: str, args) -> str:
        if name != "matmul":
            return {"ffn_bundles": "ffn (bundles)", "act_mul": "ffn act"}.get(name, name)
        rows, cfg = args[0].rows, self.cfg
        if self.in_ffn:
            return "ffn down" if rows == cfg.d_model else "ffn gate+up"
        if rows == cfg.vocab_size:
            return "head"
        if rows == cfg.n_experts:
            return "moe router"
        nq, nk = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        return {nq: "attn_q/o", nk: "attn_k/v", cfg.d_model: "attn_q/o",
                nq + 2 * nk: "attn_qkv (fused)"}.get(rows, "matmul_other")

    def wrap(self, name: str, fn):
        def timed(*args, **kw):
            if not self.on:
                return fn(*args, **kw)
            t0 = self.clock()
            out = fn(*args, **kw)
            op = self.op_of(name, args)
            self.s[op] += self.clock() - t0
            self.n[op] += 1
            return out
        return timed


    def wrap_call(self, op: str, call):
        """call (a method: a block's or a mixture of experts' one C call) charged to op, less
        what the ops it calls were charged (the router's matmul is "moe router")."""
        def timed(*args, **kw):
            if not self.on:
                return call(*args, **kw)
            before = sum(self.s.values())
            t0 = self.clock()
            try:
                return call(*args, **kw)
            finally:
                inner = sum(self.s.values()) - before
                self.s[op] += self.clock() - t0 - inner
                self.n[op] += 1
        return timed

    def wrap_ffn(self, call):
        """DenseFfn.__call__ charged to "ffn (python)" beyond its kernel calls."""
        def timed(ffn, *args):
            if not self.on:
                return call(ffn, *args)
            before = sum(self.s.values())
            t0 = self.clock()
            self.in_ffn = True
            try:
                return call(ffn, *args)
            finally:
                self.in_ffn = False
                inner = sum(self.s.values()) - before
                self.s["ffn (python)"] += self.clock() - t0 - inner
        return timed


def load(path: Path, threads: int, n_ctx: int) -> Model:
    flash = open_flash(path)
    return Model(flash, n_threads=threads, n_ctx=n_ctx, kv_dtype="f16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=Path, help="a text file (default: 64 copies of one token)")
    ap.add_argument("--cpu", action="store_true", help="charge each op its thread CPU time "
                    "instead of wall time (with --threads 1: the kernel runs on that thread)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    path = args.model
    if not path.exists():
        from flashllm.cli.app import cache_dir
        path = cache_dir() / "converted" / f"{args.model}-native"
    flash = open_flash(path)
    if args.prompt:
        ids = Tokenizer.from_flash(flash).encode(args.prompt.read_text())
    else:
        ids = [100] * 64
    net = load(path, args.threads, len(ids) + args.tokens + 1)
    timers = Timers(net.config, time.thread_time if args.cpu else time.perf_counter)
    for name in WRAPPED:
        setattr(kernel, name, timers.wrap(name, getattr(kernel, name)))
    DenseFfn.__call__ = timers.wrap_ffn(DenseFfn.__call__)
    for cls, name, op in CALLS:
        setattr(cls, name, timers.wrap_call(op, getattr(cls, name)))
    c0, t0 = time.process_time(), time.perf_counter()
    logits = net.forward(np.asarray(ids, np.int32), 0, last_only=True)       # (1, vocab)
    prefill, prefill_cpu = time.perf_counter() - t0, time.process_time() - c0
    tok, pos = int(np.argmax(logits[-1])), len(ids)
    timers.on = True
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(args.tokens):
        logits = net.forward(np.asarray([tok], np.int32), pos)               # (1, vocab)
        tok, pos = int(np.argmax(logits[-1])), pos + 1
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = args.tokens
    per = {op: 1e3 * s / n for op, s in sorted(timers.s.items(), key=lambda kv: -kv[1])}
    per["python"] = 1e3 * ((cpu if args.cpu else total) - sum(timers.s.values())) / n
    out = {"model": str(path), "threads": args.threads, "prompt_tokens": len(ids),
           "prefill_tok_s": len(ids) / prefill,
           "prefill_cpu_ms_per_token": 1e3 * prefill_cpu / len(ids), "decode_tok_s": n / total,
           "ms_per_token": 1e3 * total / n, "cpu_ms_per_token": 1e3 * cpu / n, "ops_ms": per,
           "calls_per_token": {op: c / n for op, c in timers.n.items()}}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{path.name}: prefill {out['prefill_tok_s']:.1f} tok/s ({len(ids)} tokens, "
          f"{out['prefill_cpu_ms_per_token']:.2f} CPU ms a token), "
          f"decode {out['decode_tok_s']:.2f} tok/s = {out['ms_per_token']:.2f} ms/token "
          f"({out['cpu_ms_per_token']:.2f} ms of CPU time, all threads)")
    for op, ms in per.items():
        print(f"  {op:12s} {ms:7.2f} ms  {100 * ms / out['ms_per_token']:5.1f}%  "
              f"{out['calls_per_token'].get(op, 0):.0f} calls")


if __name__ == "__main__":
    main()
