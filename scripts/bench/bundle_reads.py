"""Neuron-bundle reads through the C reader next to the device profile (make bench-io).

For each fraction (2%, 10%, 50%) every layer gets a random sorted subset of its neurons, read
with Reader.read_bundles into a preallocated (n, stride) matrix the way `flashllm run` reads a
layer's missing bundles: the cost model's thread count, merge gap and per-batch read size
(costmodel.batch_reads). Reported: device GiB/s (bytes read / time in the reader, one batch =
one layer), useful GiB/s (bundle bytes / time), the average read size, and two references at
that read size and the same thread count (ratio = the median of the rounds' ratios):
  - "in-run": the profile's own random-read cells (profile.measure_cell: long batches of
    chunk-aligned random reads) at the power-of-two chunk sizes around the expected read size,
    measured on the same file with the same reader after every `--group` layers, so bundle
    batches and reference see the same machine load; log-interpolated at the round's average
    read size. One ratio per round (`--rounds` passes over all layers).
  - "saved": the device's saved profile (`flashllm profile`), log-interpolated the same way.

    python -m scripts.bench.bundle_reads MODEL_DIR          # a converted model's ffn.bin
    python -m scripts.bench.bundle_reads --synthetic DIR --stride 1536 --n-ff 8960 --layers 16
"""
from __future__ import annotations

import argparse
import os
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from flashllm.cli.app import cache_dir  # the CLI's cache folder, env included
from flashllm.storage.costmodel import CostModel, batch_reads, bundle_requests
from flashllm.ffi.reader import Reader, aligned_empty, plan_reads
from flashllm.runtime.plan import READER_STAGE  # the staging size `run` opens readers with
from flashllm.storage.profile import (CHUNKS, DST_BYTES, Profile, device_of, load_profile,
                                     measure_cell, scratch_file)
from flashllm.units import GiB

FRACTIONS = (0.02, 0.10, 0.50)
ALIGN_LAYER = 4096


def synthetic_layout(n_layers: int, n_ff: int, stride: int) -> Tuple[List[int], int]:
    """Layer offsets of an ffn.bin-like file (4096-aligned layers after a 4096 header), size."""
    layer_bytes = -(-n_ff * stride // ALIGN_LAYER) * ALIGN_LAYER
    offsets = [ALIGN_LAYER + i * layer_bytes for i in range(n_layers)]
    return offsets, ALIGN_LAYER + n_layers * layer_bytes


def interpolate(points: List[Tuple[int, float]], read_size: float) -> float:
    """GiB/s at read_size from (chunk, GiB/s) points, linear in log2(chunk)."""
    chunks, gib = np.array(sorted(points), dtype=np.float64).T  # (k,) (k,)
    return float(np.interp(np.log2(read_size), np.log2(chunks), gib))


def saved_gib_s(profile: Optional[Profile], read_size: float, threads: int) -> Optional[float]:
    """The saved profile's random-read GiB/s at read_size bytes and `threads`."""
    cells = [(c.chunk, c.gib_s) for c in profile.cells
             if c.kind == "random" and c.threads == threads] if profile else []
    return interpolate(cells, read_size) if cells else None


def bracket(read_size: float) -> Tuple[int, int]:
    """The profile's chunk sizes just below and above read_size."""
    lo = max([c for c in CHUNKS if c <= read_size] or [CHUNKS[0]])
    return lo, min([c for c in CHUNKS if c >= read_size] or [CHUNKS[-1]])


def layer_batch(reader: Reader, base: int, n_ff: int, stride: int, n: int, model: CostModel,
                rng: np.random.Generator, out: np.ndarray) -> None:
    """One layer's batch: n random bundles, the merge gap and read size `run` would use."""
    ids = np.sort(rng.choice(n_ff, n, replace=False))  # (n,)
    gap, run = batch_reads(model, *bundle_requests(base, stride, ids), reader.n_threads)
    reader.read_bundles(base, stride, ids, out, np.arange(n), max_gap=gap, max_run=run)


def bench_row(reader: Reader, offsets: List[int], n_ff: int, stride: int, n: int,
              model: CostModel, args: argparse.Namespace, rng: np.random.Generator) -> dict:
    """Rounds of: passes over every layer's bundle batch (until the round has read bundles for
    --min-seconds), in groups of layers, each group followed by the profile's cells at the chunk
    sizes around the expected read size. Per round: the bundle counters and the reference GiB/s
    at the round's average read size."""
    out = np.empty((n, stride), dtype=np.uint8)  # (n, stride) the layer's slots
    dst = aligned_empty(DST_BYTES)  # (DST_BYTES,) the reference cells' destination
    offs, lens = bundle_requests(offsets[0], stride, rng.choice(n_ff, n, replace=False))  # (n,) (n,)
    reads, nbytes, _ = plan_reads(offs, lens, *batch_reads(model, offs, lens, reader.n_threads))
    chunks = sorted(set(bracket(nbytes / reads)))
    row: dict = dict(passes=[], refs=[])
    for _ in range(args.rounds):
        tot = dict(reads=0, bytes_read=0, bytes_requested=0, seconds=0.0, batches=0)
        ref = {c: [0, 0.0] for c in chunks}  # chunk -> [bytes, seconds]
        while tot["seconds"] < args.min_seconds:  # passes over all layers
            for g in range(0, len(offsets), args.group):
                reader.reset_stats()
                for base in offsets[g:g + args.group]:
                    layer_batch(reader, base, n_ff, stride, n, model, rng, out)
                st = reader.stats()
                for k in tot:
                    tot[k] += getattr(st, k)
                for c in chunks:
                    cell = measure_cell(reader, "random", c, args.ref_seconds, rng, dst)
                    ref[c][0] += cell.reads * c
                    ref[c][1] += cell.seconds
        avg = tot["bytes_read"] / tot["reads"]
        row["passes"].append(dict(tot, avg_read=avg, gib_s=tot["bytes_read"] / tot["seconds"] / GiB))
        row["refs"].append(interpolate([(c, b / sec / GiB) for c, (b, sec) in ref.items()], avg))
    return row


def bench(path: Path, offsets: List[int], n_ff: int, stride: int, model: CostModel,
          args: argparse.Namespace) -> List[dict]:
    rng, rows = np.random.default_rng(args.seed), []
    for fraction in FRACTIONS:
        n = max(1, int(round(fraction * n_ff)))
        sample = bundle_requests(offsets[0], stride, rng.choice(n_ff, n, replace=False))
        threads = args.threads or model.plan(*sample).threads
        with Reader(path, n_threads=threads, ring=not args.pool, stage_bytes=READER_STAGE) as reader:
            row = bench_row(reader, offsets, n_ff, stride, n, model, args, rng)
            engine = "io_uring" if reader.ring else "pool"
        rows.append(dict(row, fraction=fraction, threads=threads, engine=engine))
    return rows


def report(rows: List[dict], profile: Optional[Profile]) -> None:
    print("| neurons/layer | engine | threads | reads/layer | avg read | device GiB/s | useful GiB/s "
          "| in-run profile GiB/s | ratio | ratio per round | saved profile GiB/s | ratio to saved |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        dev = [p["gib_s"] for p in r["passes"]]
        ratios = " / ".join(f"{d / ref:.2f}" for d, ref in zip(dev, r["refs"]))
        avg = float(np.mean([p["avg_read"] for p in r["passes"]]))
        reads = float(np.mean([p["reads"] / p["batches"] for p in r["passes"]]))
        useful = float(np.median([p["bytes_requested"] / p["seconds"] / GiB for p in r["passes"]]))
        saved = saved_gib_s(profile, avg, r["threads"])
        to_saved = f"{np.median(dev) / saved:.2f}" if saved else "–"
        print(f"| {r['fraction']:.0%} | {r['engine']} | {r['threads']} | {reads:.1f} | {avg / 1024:.1f} KiB | "
              f"{np.median(dev):.3f} | {useful:.3f} | {np.median(r['refs']):.3f} | "
              f"{np.median(np.array(dev) / np.array(r['refs'])):.2f} | {ratios} | "
              f"{'–' if saved is None else f'{saved:.3f}'} | {to_saved} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", type=Path, help="Converted model folder.")
    ap.add_argument("--synthetic", type=Path, help="Folder for a synthetic ffn.bin-like file.")
    ap.add_argument("--stride", type=int, default=1536)
    ap.add_argument("--n-ff", type=int, default=8960)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="Alternating passes + references.")
    ap.add_argument("--ref-seconds", type=float, default=0.05,
                    help="Per reference cell, after each group of layers.")
    ap.add_argument("--group", type=int, default=7, help="Layers between reference cells.")
    ap.add_argument("--min-seconds", type=float, default=0.25,
                    help="Bundle-reading time per round (small fractions take several passes).")
    ap.add_argument("--threads", type=int, help="Force a thread count (default: the cost model's).")
    ap.add_argument("--pool", action="store_true", help="The thread pool instead of io_uring.")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with ExitStack() as stack:
        if args.model is not None:
            from flashllm.format.reader import open_flash
            ffn = open_flash(args.model).ffn
            path, offsets, n_ff, stride = ffn.file, list(ffn.layer_offsets), ffn.n_ff, ffn.stride
        elif args.synthetic is not None:
            offsets, size = synthetic_layout(args.layers, args.n_ff, args.stride)
            path, n_ff, stride = stack.enter_context(scratch_file(args.synthetic, size)), args.n_ff, args.stride
        else:
            ap.error("give MODEL or --synthetic FOLDER")
        model = CostModel.for_path(cache_dir(), path)
        profile = load_profile(cache_dir(), device_of(path))
        print(f"{path}: {len(offsets)} layers × {n_ff} bundles of {stride} B; cost model: {model.source}; "
              f"load average {' / '.join(f'{x:.2f}' for x in os.getloadavg())}", file=sys.stderr)
        if model.hint:
            print(model.hint, file=sys.stderr)
        rows = bench(path, offsets, n_ff, stride, model, args)
    report(rows, profile)
    print(f"load average at the end: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}", file=sys.stderr)


if __name__ == "__main__":
    main()
