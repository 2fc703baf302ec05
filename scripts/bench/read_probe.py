"""The device's random direct-read rate right now: one `flashllm profile` cell, measured longer.

Run:  python -m scripts.bench.read_probe FILE [--chunk 256KiB] [--threads 8] [--seconds 4] [--repeat N]
      [--busy N]
Reads chunk-sized, chunk-aligned random requests of FILE with `threads` in flight through the C
reader for `seconds` (profile.measure_cell, the profile's own measurement) and prints
{"gib_s": ..., "chunk": ..., "threads": ..., "seconds": ..., "busy": N}. bench.py takes it right
before and right after each capped run, so the run's read rate can be set against the device's
rate of those minutes: a virtual machine's disk can drift by tens of percent over seconds
(docs/MEASUREMENTS.md; see it with --seconds 2 --repeat 20, one JSON line per window). --busy N
keeps N processes spinning at the lowest scheduling priority (SCHED_IDLE) while it reads: on a
virtual machine whose host handles the guest's I/O on the same CPUs, the rate then shows what a
run's compute leaves the disk (docs/MEASUREMENTS.md, "Session 22").
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from flashllm.ffi.reader import Reader, aligned_empty
from flashllm.storage.profile import DST_BYTES, measure_cell
from flashllm.units import parse_size


def probe(path: Path, chunk: int, threads: int, seconds: float) -> dict:
    """GiB/s of random direct reads of chunk bytes, `threads` in flight, for about seconds."""
    chunk = max(4096, chunk // 4096 * 4096)
    with Reader(path, n_threads=threads, stage_bytes=max(chunk, 1 << 20)) as reader:
        cell = measure_cell(reader, "random", chunk, seconds, np.random.default_rng(),
                            aligned_empty(DST_BYTES))
    return {"gib_s": cell.gib_s, "chunk": chunk, "threads": threads, "seconds": cell.seconds}


SPIN = ("import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
        "while True: pass")


def spinners(n: int) -> list:
    """n processes busy-looping at SCHED_IDLE (the guest then yields every CPU the reader's
    thread wants; what remains is the host's share)."""
    return [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--chunk", default="256KiB")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=1, help="windows measured back to back")
    ap.add_argument("--busy", type=int, default=0, help="processes spinning at SCHED_IDLE "
                    "while it reads")
    args = ap.parse_args()
    busy = spinners(args.busy) if hasattr(os, "SCHED_IDLE") else []
    try:
        for _ in range(args.repeat):
            cell = probe(args.file, parse_size(args.chunk), args.threads, args.seconds)
            print(json.dumps({**cell, "busy": len(busy)}), flush=True)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
