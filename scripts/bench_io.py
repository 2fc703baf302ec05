"""Neuron-bundle reads through the C reader next to the device profile (make bench-io).

For each fraction (2%, 10%, 50%) every layer gets a random sorted subset of its neurons, read
with Reader.read_bundles into a preallocated (n, stride) matrix, with the threads and merge gap
the cost model picks. Reported: device GiB/s (bytes read / time in the reader), useful GiB/s
(bundle bytes / time), the average read size, and the profile's random-read GiB/s at that size
and thread count (log-interpolated between its chunk sizes) with the ratio.

    python scripts/bench_io.py MODEL_DIR               # a converted model's ffn.bin
    python scripts/bench_io.py --synthetic /work/scratch --stride 1536 --n-ff 8960 --layers 16
"""
from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flashllm.cli import cache_dir  # noqa: E402  (the CLI's cache folder, env included)
from flashllm.costmodel import CostModel, bundle_requests  # noqa: E402
from flashllm.ioreader import Reader  # noqa: E402
from flashllm.profile import GiB, Profile, device_of, load_profile, scratch_file  # noqa: E402

FRACTIONS = (0.02, 0.10, 0.50)
ALIGN_LAYER = 4096


def synthetic_layout(n_layers: int, n_ff: int, stride: int) -> Tuple[List[int], int]:
    """Layer offsets of an ffn.bin-like file (4096-aligned layers after a 4096 header), size."""
    layer_bytes = -(-n_ff * stride // ALIGN_LAYER) * ALIGN_LAYER
    offsets = [ALIGN_LAYER + i * layer_bytes for i in range(n_layers)]
    return offsets, ALIGN_LAYER + n_layers * layer_bytes


def profile_gib_s(profile: Optional[Profile], read_size: float, threads: int) -> Optional[float]:
    """The profile's random-read GiB/s at read_size bytes and `threads`, log-interpolated."""
    if profile is None:
        return None
    cells = sorted((c.chunk, c.gib_s) for c in profile.cells
                   if c.kind == "random" and c.threads == threads)
    if not cells:
        return None
    chunks, gib = np.array(cells, dtype=np.float64).T  # (k,) (k,)
    return float(np.interp(np.log2(read_size), np.log2(chunks), gib))


def bench_fraction(path: Path, offsets: List[int], n_ff: int, stride: int, fraction: float,
                   model: CostModel, rounds: int, rng: np.random.Generator, readers: dict,
                   stack: ExitStack) -> dict:
    n = max(1, int(round(fraction * n_ff)))
    first = bundle_requests(offsets[0], stride, np.sort(rng.choice(n_ff, n, replace=False)))
    plan = model.plan(*first)
    if plan.threads not in readers:
        readers[plan.threads] = stack.enter_context(Reader(path, n_threads=plan.threads))
    reader = readers[plan.threads]
    out = np.empty((n, stride), dtype=np.uint8)  # (n, stride) the layer's slots
    slots = np.arange(n)  # (n,)
    reader.reset_stats()
    for _ in range(rounds):
        for base in offsets:
            ids = np.sort(rng.choice(n_ff, n, replace=False))  # (n,)
            reader.read_bundles(base, stride, ids, out, slots, max_gap=plan.max_gap,
                                max_run=plan.max_run)
    s = reader.stats()
    return dict(fraction=fraction, threads=plan.threads, max_gap=plan.max_gap, stats=s,
                predicted=plan.seconds * len(offsets) * rounds)


def report(rows: List[dict], profile: Optional[Profile]) -> None:
    print("| neurons/layer | threads | merge gap | avg read | reads | device GiB/s | useful GiB/s "
          "| profile GiB/s at that read size | ratio | model's predicted time / measured |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        s = r["stats"]
        ref = profile_gib_s(profile, s.avg_read, r["threads"])
        useful = s.bytes_requested / s.seconds / GiB
        ratio = f"{s.gib_per_s / ref:.2f}" if ref else "–"
        print(f"| {r['fraction']:.0%} | {r['threads']} | {r['max_gap'] // 1024} KiB | "
              f"{s.avg_read / 1024:.1f} KiB | {s.reads} | {s.gib_per_s:.3f} | {useful:.3f} | "
              f"{ref if ref is None else round(ref, 3)} | {ratio} | {r['predicted'] / s.seconds:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", type=Path, help="Converted model folder.")
    ap.add_argument("--synthetic", type=Path, help="Folder for a synthetic ffn.bin-like file.")
    ap.add_argument("--stride", type=int, default=1536)
    ap.add_argument("--n-ff", type=int, default=8960)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="Passes over all layers per fraction.")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with ExitStack() as stack:
        if args.model is not None:
            from flashllm.bundle import open_flash
            ffn = open_flash(args.model).ffn
            path, offsets, n_ff, stride = ffn.file, list(ffn.layer_offsets), ffn.n_ff, ffn.stride
        elif args.synthetic is not None:
            offsets, size = synthetic_layout(args.layers, args.n_ff, args.stride)
            path, n_ff, stride = stack.enter_context(scratch_file(args.synthetic, size)), args.n_ff, args.stride
        else:
            ap.error("give MODEL or --synthetic FOLDER")
        model = CostModel.for_path(cache_dir(), path)
        profile = load_profile(cache_dir(), device_of(path))
        print(f"{path}: {len(offsets)} layers × {n_ff} bundles of {stride} B; cost model: {model.source}",
              file=sys.stderr)
        if model.hint:
            print(model.hint, file=sys.stderr)
        rng, readers = np.random.default_rng(args.seed), {}
        rows = [bench_fraction(path, offsets, n_ff, stride, f, model, args.rounds, rng, readers, stack)
                for f in FRACTIONS]
    report(rows, profile)


if __name__ == "__main__":
    main()
