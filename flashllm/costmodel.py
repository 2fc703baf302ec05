"""The read-plan cost model, fitted from a device profile.

For a pool of t reader threads, the time of n random reads of c bytes is modelled as
    seconds ≈ n · (a_t + c / B_t)
a_t: the pool's per-read overhead (1 / IOPS of tiny reads), B_t: its streaming bandwidth. Both
are fitted per thread count from the profile's random-read cells (1/IOPS against chunk size, least
squares on relative error). Reading a hole of g bytes to join two reads costs g / B_t and saves
a_t, so the merge gap is a_t · B_t. `plan` tries every thread count with its gap on the actual
requests (the C planner counts the reads and bytes) and keeps the fastest.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Optional, Sequence, Tuple

import numpy as np

from .ioreader import ALIGN, plan_reads
from .profile import GiB, KiB, Profile, device_of, load_profile

MIN_RUN, MAX_RUN = 64 * KiB, 1 << 20

# This machine's figures (DESIGN.md §7), used when the device has no profile: (chunk, threads, GiB/s)
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
        return int(self.overhead * self.bandwidth) // ALIGN * ALIGN


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
    def __init__(self, fits: Dict[int, Fit], source: str, hint: Optional[str] = None) -> None:
        self.fits = dict(sorted(fits.items()))
        self.source = source
        self.hint = hint

    @classmethod
    def from_points(cls, points: Iterable[Tuple[int, int, float]], source: str,
                    hint: Optional[str] = None) -> "CostModel":
        by_threads: Dict[int, list] = {}
        for chunk, threads, gib in points:
            by_threads.setdefault(threads, []).append((chunk, gib))
        fits = {t: fit_points(t, sorted(p)) for t, p in by_threads.items() if len(p) >= 2}
        return cls(fits, source, hint)

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
        """Cheapest (threads, merge gap) for these requests and the predicted read time."""
        best = None
        for t in threads or self.fits:
            fit = self.fits[t] if t in self.fits else self.fits[self.nearest(t)]
            run = run_size(offsets, lengths, t)
            reads, nbytes, gaps = plan_reads(offsets, lengths, fit.merge_gap, run)
            plan = ReadPlan(t, fit.merge_gap, run, reads, int(np.sum(lengths)), nbytes, gaps,
                            fit.seconds(reads, nbytes))
            if best is None or plan.seconds < best.seconds * 0.98:
                best = plan
        return best

    def nearest(self, threads: int) -> int:
        return min(self.fits, key=lambda t: (abs(np.log2(t / threads)), t))


def run_size(offsets: np.ndarray, lengths: np.ndarray, threads: int) -> int:
    """Largest single read: small enough that a batch gives each thread ~4 reads (64 KiB … 1 MiB)."""
    if len(offsets) == 0:
        return MAX_RUN
    span = int(np.max(offsets + lengths) - np.min(offsets))
    per_thread = -(-span // (4 * threads)) // ALIGN * ALIGN  # ~4 reads per thread: even finish
    return int(min(MAX_RUN, max(MIN_RUN, per_thread)))


def bundle_requests(base: int, stride: int, ids: np.ndarray, length: Optional[int] = None
                    ) -> Tuple[np.ndarray, np.ndarray]:
    """Offsets and lengths of neuron bundles ids (stride bytes apart from base)."""
    ids64 = np.sort(np.asarray(ids, dtype=np.int64))  # (n,)
    return base + ids64 * stride, np.full(len(ids64), length or stride, dtype=np.int64)
