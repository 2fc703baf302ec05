"""One-token decode with each block in two C calls (native/block.c) against model.py's sequence of
kernel calls, alternating in one process on the same weights (the model fully in DRAM).

Run:  python -m scripts.bench.token_blocks MODEL [--threads 2] [--tokens 128] [--rounds 3]
MODEL: a converted folder. Per round: a 64-token prefill, then --tokens greedy one-token
passes each way; prints wall and process CPU ms per token (with --threads 1 the CPU time is
what a token costs whatever else the machine runs) and the ratio.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from flashllm.format.reader import open_flash
from flashllm.runtime.model import Model


def per_token(net: Model, kernel_calls: bool, tokens: int) -> tuple[float, float]:
    """(CPU ms, wall ms) a one-token pass, through the blocks or model.py's kernel calls."""
    net.token_blocks = not kernel_calls
    net.reset()
    logits = net.forward(np.arange(100, 164), 0, last_only=True)         # (1, vocab)
    pos, c0, t0 = 64, time.process_time(), time.perf_counter()
    for _ in range(tokens):
        logits = net.forward(np.array([int(logits[-1].argmax())]), pos)  # (1, vocab)
        pos += 1
    return ((time.process_time() - c0) * 1e3 / tokens, (time.perf_counter() - t0) * 1e3 / tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    flash = open_flash(args.model)
    net = Model(flash, n_threads=args.threads, n_ctx=64 + args.tokens + 1, kv_dtype="f16")
    for _ in range(args.rounds):
        (ca, wa), (cb, wb) = per_token(net, True, args.tokens), per_token(net, False, args.tokens)
        print(f"kernel calls: CPU {ca:.2f} wall {wa:.2f} ms | blocks: CPU {cb:.2f} wall {wb:.2f} "
              f"ms | wall x{wa / wb:.2f}")


if __name__ == "__main__":
    main()
