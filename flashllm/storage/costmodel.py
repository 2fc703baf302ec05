"""The read-plan cost model, fitted from a device profile.

For a pool of t reader threads, the time of n random reads of c bytes is modelled as
    seconds ≈ n · (a_t + c / B_t)
a_t: the pool's per-read overhead (1 / IOPS of tiny reads), B_t: its streaming bandwidth. Both
are fitted per thread count from the profile's random-read cells (1/IOPS against chunk size, least
squares on relative error), after taking the upper envelope across thread counts (at each chunk
size, t threads are credited with the best figure of any t' <= t: more reads in flight can always
leave some idle, so a dip is measurement noise). Reading a hole of g bytes to join two reads
costs g / B_t and saves a_t, so the merge gap is a_t · B_t. `plan` tries every thread count with
its gap and read size on the actual requests (the C planner counts the reads and bytes), predicts
the time from the measured (enveloped) profile curve at the resulting average read size — the
a + c/B fit bends above the device's bandwidth ceiling at MiB reads — and keeps the one with the
most reads in flight among those within 10% of the fastest: the model leaves out what extra
depth hides (copying merged reads out of staging while others are in flight, the uneven end of
a batch) — on the 1.5B's 50% batches 32 in flight with ~170 KiB reads beat the model's pick of
4 threads with 1 MiB reads by ×1.3–1.6 (docs/IO.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from flashllm.ffi.reader import plan_reads
from flashllm.storage.profile import Profile, device_of, load_profile
from flashllm.units import GiB, KiB, PAGE

MIN_RUN, MAX_RUN = 64 * KiB, 1 << 20
DEPTH_TOLERANCE = 1.10    # plan: the deepest pool predicted within 10% of the fastest

# (chunk, threads, GiB/s) when the device has no profile: a virtio disk's (docs/MEASUREMENTS.md)
DEFAULT_POINTS = ((4 * KiB, 1, 0.2), (32 * KiB, 1, 1.1), (256 * KiB, 1, 1.6),
                  (4 * KiB, 4, 0.45), (32 * KiB, 4, 1.5), (256 * KiB, 4, 2.2),
                  (4 * KiB, 16, 0.6), (32 * KiB, 16, 1.9), (256 * KiB, 16, 2.4))


@dataclass(frozen=True)
class Fit:
    """seconds(n reads, nbytes) = n · overhead + nbytes / bandwidth for `threads` threads."""

    threads: int
    overhead: float    # seconds per read
    bandwidth: float   # bytes per second

    def seconds(self, n_reads: int, nbytes: int) -> float:
        return n_reads * self.overhead + nbytes / self.bandwidth

    def gib_s(self, chunk: int) -> float:
        return chunk / self.seconds(1, chunk) / GiB

    @property
    def merge_gap(self) -> int:
        """Largest hole worth reading through to save one read, in whole pages."""
        return int(self.overhead * self.bandwidth) // PAGE * PAGE


@dataclass(frozen=True)
class ReadPlan:
    """The cheapest way found to read a batch, and its predicted time."""

    threads: int
    max_gap: int
    max_run: int
    reads: int
    bytes_requested: int
    bytes_read: int
    gap_bytes: int
    seconds: float

    @property
    def gib_s(self) -> float:
        """Useful (requested) bytes per second."""
        return self.bytes_requested / self.seconds / GiB if self.seconds > 0 else 0.0


def fit_points(threads: int, points: Iterable[Tuple[int, float]]) -> Fit:
    """Fit a + c/B to (chunk bytes, GiB/s) points of one thread count."""
    chunk, gib = np.array(list(points), dtype=np.float64).T  # (k,) (k,)
    per_read = chunk / (gib * GiB)  # (k,) seconds per read = 1 / IOPS
    w = 1.0 / per_read  # (k,) relative-error weights
    design = np.stack([np.ones_like(chunk), chunk], axis=1) * w[:, None]  # (k, 2)
    (a, inv_b), *_ = np.linalg.lstsq(design, per_read * w, rcond=None)
    if inv_b <= 0:  # flat in chunk size: pure bandwidth from the largest chunk
        inv_b = per_read[-1] / chunk[-1]
    return Fit(threads, max(float(a), 1e-7), 1.0 / float(inv_b))


class CostModel:
    def __init__(self, fits: Dict[int, Fit], source: str, hint: Optional[str] = None,
                 curves: Optional[Dict[int, Sequence[Tuple[int, float]]]] = None) -> None:
        self.fits = dict(sorted(fits.items()))
        self.source = source
        self.hint = hint
        self.curves = {t: sorted(c) for t, c in (curves or {}).items()}  # t -> [(chunk, GiB/s)]

    def gib_s(self, threads: int, read_size: float) -> float:
        """Device GiB/s of reads of read_size bytes with `threads` in flight: the (enveloped)
        profile curve, log-interpolated between its chunk sizes; the fit where there is none."""
        t = threads if threads in self.fits else self.nearest(threads)
        if t not in self.curves:
            return self.fits[t].gib_s(max(read_size, 1.0))
        chunks, gib = np.array(self.curves[t], dtype=np.float64).T  # (k,) (k,)
        return float(np.interp(np.log2(max(read_size, 1.0)), np.log2(chunks), gib))

    @classmethod
    def from_points(cls, points: Iterable[Tuple[int, int, float]], source: str,
                    hint: Optional[str] = None) -> "CostModel":
        by_threads: Dict[int, list] = {}
        for chunk, threads, gib in envelope(points):
            by_threads.setdefault(threads, []).append((chunk, gib))
        fits = {t: fit_points(t, sorted(p)) for t, p in by_threads.items() if len(p) >= 2}
        return cls(fits, source, hint, {t: by_threads[t] for t in fits})

    @classmethod
    def from_profile(cls, profile: Profile) -> "CostModel":
        points = [(c.chunk, c.threads, c.gib_s) for c in profile.cells if c.kind == "random"]
        return cls.from_points(points, f"profile of {profile.device.name} ({profile.created})")

    @classmethod
    def defaults(cls, hint: Optional[str] = None) -> "CostModel":
        return cls.from_points(DEFAULT_POINTS, "built-in defaults", hint)

    @classmethod
    def for_path(cls, cache: Path, path: Path) -> "CostModel":
        """The model of the device holding path: its saved profile, else defaults and a hint."""
        device = device_of(path)
        profile = load_profile(cache, device)
        if profile is not None:
            return cls.from_profile(profile)
        return cls.defaults(f"no read profile for device {device.name}: using built-in figures; "
                            f"run `flashllm profile {path}` to measure it")

    def best_threads(self, chunk: int, within: float = 0.05) -> int:
        """Fewest threads whose throughput at chunk is within `within` of the best."""
        rates = {t: f.gib_s(chunk) for t, f in self.fits.items()}
        best = max(rates.values())
        return min(t for t, r in rates.items() if r >= (1 - within) * best)

    def plan(self, offsets: np.ndarray, lengths: np.ndarray,
             threads: Optional[Sequence[int]] = None) -> ReadPlan:
        """(threads, merge gap) for these requests: the deepest of the plans within 10% of the
        fastest predicted read time (bytes read / the profile's GiB/s at the plan's average
        read size and that depth)."""
        plans = []
        for t in sorted(threads or self.fits):
            fit = self.fits[t] if t in self.fits else self.fits[self.nearest(t)]
            run = run_size(offsets, lengths, t)
            reads, nbytes, gaps = plan_reads(offsets, lengths, fit.merge_gap, run)
            seconds = nbytes / (self.gib_s(t, nbytes / max(reads, 1)) * GiB) if reads else 0.0
            plans.append(ReadPlan(t, fit.merge_gap, run, reads, int(np.sum(lengths)), nbytes, gaps,
                                  seconds))
        fastest = min(p.seconds for p in plans)
        return [p for p in plans if p.seconds <= fastest * DEPTH_TOLERANCE][-1]

    def nearest(self, threads: int) -> int:
        return min(self.fits, key=lambda t: (abs(np.log2(t / threads)), t))


def envelope(points: Iterable[Tuple[int, int, float]]) -> List[Tuple[int, int, float]]:
    """(chunk, threads, GiB/s) points with GiB/s raised to the best of any fewer threads."""
    pts = sorted(points, key=lambda p: (p[0], p[1]))
    best: Dict[int, float] = {}
    out = []
    for chunk, threads, gib in pts:
        best[chunk] = max(best.get(chunk, 0.0), gib)
        out.append((chunk, threads, best[chunk]))
    return out


def run_size(offsets: np.ndarray, lengths: np.ndarray, threads: int) -> int:
    """Largest single read: small enough that a batch gives each thread ~4 reads (64 KiB … 1 MiB)."""
    if len(offsets) == 0:
        return MAX_RUN
    span = int(np.max(offsets + lengths) - np.min(offsets))
    per_thread = -(-span // (4 * threads)) // PAGE * PAGE  # ~4 reads per thread: even finish
    return int(min(MAX_RUN, max(MIN_RUN, per_thread)))


def bundle_requests(base: int, stride: int, ids: np.ndarray, length: Optional[int] = None
                    ) -> Tuple[np.ndarray, np.ndarray]:
    """Offsets and lengths of neuron bundles ids (stride bytes apart from base)."""
    ids64 = np.sort(np.asarray(ids, dtype=np.int64))  # (n,)
    return base + ids64 * stride, np.full(len(ids64), length or stride, dtype=np.int64)


def batch_reads(model: CostModel, offsets: np.ndarray, lengths: np.ndarray, threads: int
                ) -> Tuple[int, int]:
    """(max_gap, max_run) for one batch read by a pool of `threads`: what `run` passes."""
    return model.fits[model.nearest(threads)].merge_gap, run_size(offsets, lengths, threads)
