"""flashllm's profile against fio on the same file: random direct reads, chunk sizes × threads.

Each cell is measured by fio (direct=1, randread aligned to the block size) and by flashllm's
profile cell (profile.measure_cell through the C reader), alternating, `--rounds` times; the table
shows medians and the ratio. The same mechanism on both sides: when the reader runs on io_uring
(the default where the kernel has it), fio uses ioengine=io_uring with iodepth = threads in one
job; with the thread pool (`--pool`), psync with numjobs = threads. Needs fio on PATH.

    python -m scripts.bench.fio_compare DIR --size 1GiB --seconds 3 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from flashllm.ffi.reader import Reader, aligned_empty
from flashllm.storage.profile import DST_BYTES, measure_cell, scratch_file
from flashllm.units import GiB, KiB, parse_size

CHUNKS = (4 * KiB, 32 * KiB, 256 * KiB)
THREADS = (1, 16)


def fio_cell(path: Path, chunk: int, threads: int, seconds: float, ring: bool) -> float:
    """GiB/s that fio reports for random direct reads of chunk bytes, threads in flight."""
    engine = (["--ioengine=io_uring", f"--iodepth={threads}", "--numjobs=1"] if ring else
              ["--ioengine=psync", f"--numjobs={threads}"])
    cmd = ["fio", "--name=cmp", f"--filename={path}", "--rw=randread", f"--bs={chunk}",
           "--direct=1", *engine, "--thread", "--time_based",
           f"--runtime={seconds}", "--group_reporting", "--output-format=json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)["jobs"][0]["read"]["bw_bytes"] / GiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="Folder on the device to measure.")
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--seconds", type=float, default=3.0, help="Per cell and tool, per round.")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pool", action="store_true", help="The reader's thread pool (fio: psync).")
    args = ap.parse_args()
    if shutil.which("fio") is None:
        sys.exit("fio is not installed (apt-get install -y fio)")
    rng = np.random.default_rng(0)
    dst = aligned_empty(DST_BYTES)  # (DST_BYTES,)
    rows = []
    with scratch_file(args.folder, parse_size(args.size)) as path:
        for threads in THREADS:
            with Reader(path, n_threads=threads, stage_bytes=max(CHUNKS), ring=not args.pool) as reader:
                for chunk in CHUNKS:
                    ours, theirs = [], []
                    for _ in range(args.rounds):
                        theirs.append(fio_cell(path, chunk, threads, args.seconds, reader.ring))
                        ours.append(measure_cell(reader, "random", chunk, args.seconds, rng, dst).gib_s)
                    rows.append((chunk, threads, float(np.median(ours)), float(np.median(theirs))))
                    print(f"{chunk // KiB} KiB × {threads}: flashllm {ours} fio {theirs}", file=sys.stderr)
    print("| chunk | threads | flashllm profile GiB/s | fio GiB/s | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for chunk, threads, ours, theirs in rows:
        print(f"| {chunk // KiB} KiB | {threads} | {ours:.3f} | {theirs:.3f} | {ours / theirs:.2f} |")


if __name__ == "__main__":
    main()
