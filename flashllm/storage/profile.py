"""Device read-throughput profile: measure direct-I/O reads, save and load them per device.

`measure` reads a file through the C reader (ffi/reader.Reader, its default engine) with direct
I/O: sequential 1 MiB reads, then random reads aligned to the chunk size over a grid of chunk
sizes × thread counts (reads in flight), three passes over the grid, median per cell.
`scratch_file` makes (and always removes) the file to measure on the device holding a folder.
Profiles are stored as JSON in `<cache>/profiles/`, keyed by the device (st_dev and its name);
the cache folder comes from the caller. The cost model that uses them is in costmodel.py.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import contextlib
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence

import numpy as np

from flashllm.limits import loads_json
from flashllm.errors import FlashError
from flashllm.ffi.reader import Reader, aligned_empty
from flashllm.units import GiB, KiB, MiB

CHUNKS = tuple(4 * KiB << i for i in range(9))  # 4 KiB … 1 MiB
THREADS = (1, 2, 4, 8, 16, 32)
SEQ_CHUNK = 1 * MiB
SEQ_THREADS = (1, 4)
DST_BYTES = 32 * MiB          # destination buffer reused by every batch of a cell
BATCH_BYTES = 256 * MiB       # upper bound of one batch's requested bytes
REPEATS = 3                   # passes over the grid; a cell is its median pass
KEEP_FREE = 1 * GiB           # free space a scratch file must leave on its device


class ProfileError(FlashError):
    """A profile that cannot be measured, read or written."""


@dataclass(frozen=True)
class Device:
    """The block device holding a path: st_dev numbers and a name (vda, nvme0n1, …)."""

    major: int
    minor: int
    name: str

    @property
    def key(self) -> str:
        return f"{self.name}-{self.major}-{self.minor}"


@dataclass(frozen=True)
class Cell:
    """One measurement: `kind` reads of `chunk` bytes with `threads` threads."""

    kind: str          # "random" or "seq"
    chunk: int
    threads: int
    gib_s: float
    iops: float
    reads: int
    seconds: float


@dataclass
class Profile:
    device: Device
    direct: bool
    file_bytes: int
    created: str
    cells: List[Cell] = field(default_factory=list)
    engine: str = "pool"  # the reader's engine: "io_uring" (threads = reads in flight) or "pool"

    def get(self, kind: str, chunk: int, threads: int) -> Optional[Cell]:
        return next((c for c in self.cells
                     if (c.kind, c.chunk, c.threads) == (kind, chunk, threads)), None)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        """Inverse of to_dict; ValueError/KeyError/TypeError on anything malformed."""
        dev = d["device"]
        device = Device(_typed(dev["major"], int), _typed(dev["minor"], int), _typed(dev["name"], str))
        cells = [_cell(c) for c in _typed(d["cells"], list)]
        return cls(device, _typed(d["direct"], bool), _typed(d["file_bytes"], int),
                   _typed(d["created"], str), cells, _typed(d.get("engine", "pool"), str))


def _typed(value, kind: type):
    """value when it is a kind (bool is not an int; an int is a float); else TypeError."""
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise TypeError(f"{value!r} is not a {kind.__name__}")
    return value


def _cell(c: dict) -> Cell:
    cell = Cell(kind=_typed(c["kind"], str), chunk=_typed(c["chunk"], int), threads=_typed(c["threads"], int),
                gib_s=float(_typed(c["gib_s"], float)), iops=float(_typed(c["iops"], float)),
                reads=_typed(c["reads"], int), seconds=float(_typed(c["seconds"], float)))
    numbers = (cell.chunk, cell.threads, cell.gib_s, cell.iops, cell.seconds)
    if cell.kind not in ("random", "seq") or not all(0 < v < float("inf") for v in numbers) or cell.reads < 0:
        raise ValueError(f"bad measurement {c!r}")
    return cell


def device_of(path: Path) -> Device:
    """The device of the filesystem holding path (or its nearest existing parent)."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    uevent = Path(f"/sys/dev/block/{major}:{minor}/uevent")
    name = f"dev{major}_{minor}"
    if uevent.is_file():
        for line in uevent.read_text().splitlines():
            if line.startswith("DEVNAME="):
                name = line.split("=", 1)[1].replace("/", "_")
    return Device(major, minor, name)


def profile_path(cache: Path, device: Device) -> Path:
    return Path(cache) / "profiles" / f"{device.key}.json"


def save_profile(profile: Profile, cache: Path) -> Path:
    """Write atomically (temporary name, fsync, rename); returns the path."""
    path = profile_path(cache, profile.device)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")     # two profiles at once: each its own
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(profile.to_dict(), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise ProfileError(f"cannot save the profile in {path.parent}: {e.strerror or e}") from None
    return path


def load_profile(cache: Path, device: Device) -> Optional[Profile]:
    """The saved profile of device, None when there is none."""
    path = profile_path(cache, device)
    if not path.is_file():
        return None
    try:
        return Profile.from_dict(loads_json(path.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise ProfileError(f"profile {path} is unreadable ({e}); run `flashllm profile` again") from e


@contextmanager
def scratch_file(folder: Path, size: int, progress: Callable[[int], None] = lambda n: None
                 ) -> Iterator[Path]:
    """A file of `size` random bytes in folder, removed on exit (also on Ctrl-C)."""
    size = -(-size // SEQ_CHUNK) * SEQ_CHUNK  # whole MiB, rounded up
    path = Path(folder) / f".flashllm-profile-{os.getpid()}.tmp"
    free = shutil.disk_usage(folder).free
    if size > free - KEEP_FREE:               # the device stays usable while it is measured
        raise ProfileError(f"a {size >> 20} MiB scratch file would leave less than "
                           f"{KEEP_FREE >> 20} MiB of the {free >> 20} MiB free in {folder}: "
                           "give a smaller --size")
    block = np.random.default_rng(0).integers(0, 256, min(size, 8 * MiB), dtype=np.uint8).tobytes()
    try:
        try:
            with open(path, "wb") as f:
                for done in range(0, size, len(block)):
                    f.write(block[:size - done])
                    progress(min(len(block), size - done))
                f.flush()
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise ProfileError(f"cannot write a {size} byte scratch file in {folder}: "
                               f"{e.strerror or e}") from None
        yield path
    finally:
        with contextlib.suppress(OSError):      # e.g. folder is not one: nothing was made
            path.unlink(missing_ok=True)


def measure_cell(reader: Reader, kind: str, chunk: int, seconds: float,
                 rng: np.random.Generator, dst: np.ndarray) -> Cell:
    """Read `chunk`-sized requests in batches for about `seconds` (at least one batch)."""
    n_chunks = reader.file_size // chunk
    if n_chunks < 1:
        raise ProfileError(f"{reader.path} is smaller than one {chunk} byte read")
    per_batch = int(min(max(64, 16 * reader.n_threads), max(4 * reader.n_threads, BATCH_BYTES // chunk)))
    slots = dst.nbytes // chunk
    reader.reset_stats()
    pos = int(rng.integers(0, n_chunks))
    while True:
        if kind == "seq":
            ids = (pos + np.arange(per_batch)) % n_chunks  # (per_batch,)
            pos = int(ids[-1]) + 1
        else:
            ids = rng.integers(0, n_chunks, per_batch)  # (per_batch,)
        reader.read(ids * chunk, np.full(per_batch, chunk), dst,
                    (np.arange(per_batch) % slots) * chunk, max_gap=-1, max_run=chunk)
        stats = reader.stats()
        if stats.seconds >= seconds:
            break
    return Cell(kind, chunk, reader.n_threads, stats.bytes_read / stats.seconds / GiB,
                stats.reads / stats.seconds, stats.reads, stats.seconds)


def measure(path: Path, seconds: float, chunks: Sequence[int] = CHUNKS,
            threads: Sequence[int] = THREADS, on_cell: Callable[[Cell], None] = lambda c: None,
            seed: int = 0, repeats: int = REPEATS) -> Profile:
    """Profile reads of the existing file path (read-only); `seconds` is the total budget.

    The grid is measured `repeats` times over (whole passes, so a burst of load elsewhere hits
    one sample of a cell, not all); each cell is its median sample. on_cell sees every sample."""
    grid = [("seq", SEQ_CHUNK, t) for t in SEQ_THREADS] + \
           [("random", c, t) for t in threads for c in chunks]
    per_cell = seconds / len(grid) / repeats
    rng = np.random.default_rng(seed)
    dst = aligned_empty(DST_BYTES)  # (DST_BYTES,) reused; its contents are never looked at
    samples: dict = {key: [] for key in grid}
    direct, size, engine = True, 0, "pool"
    for _ in range(repeats):
        for n_threads in sorted({t for _, _, t in grid}):
            with Reader(path, n_threads=n_threads, stage_bytes=max(max(chunks), SEQ_CHUNK)) as reader:
                direct, size = direct and reader.direct, reader.file_size
                engine = "io_uring" if reader.ring else "pool"
                for kind, chunk, t in grid:
                    if t == n_threads:
                        samples[(kind, chunk, t)].append(
                            measure_cell(reader, kind, chunk, per_cell, rng, dst))
                        on_cell(samples[(kind, chunk, t)][-1])
    cells = [median_cell(samples[key]) for key in sorted(grid, key=lambda k: (k[2], k[0] != "seq", k[1]))]
    created = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return Profile(device_of(path), direct, size, created, cells, engine)


def median_cell(samples: List[Cell]) -> Cell:
    """The sample with the median throughput (the lower middle one of an even count)."""
    ranked = sorted(samples, key=lambda c: c.gib_s)
    return ranked[(len(ranked) - 1) // 2]
