"""Run a command under a cgroup-v1 memory cap, optionally from a cold page cache.

Run:  python -m scripts.bench.cgroup_run [--limit 560MiB] [--cold] [--json] -- CMD ARGS...

A fresh group is made under /sys/fs/cgroup/memory, memory.limit_in_bytes is written (no limit when
--limit is absent: the group then only measures), the child moves itself into the group before
exec, and after it exits memory.max_usage_in_bytes (the peak of anonymous memory + page cache
charged to the group), memory.failcnt (how often the limit was hit) and the OOM kill count are
read and the group is removed. --cold syncs and drops the page cache first (echo 3 >
/proc/sys/vm/drop_caches), so file pages are read from the device and charged to this group.

Needs root and a mounted v1 memory controller; otherwise it says why and exits with code 3
(bench.py skips the capped rows with that message).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path("/sys/fs/cgroup/memory")
UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30,
         "KB": 1000, "MB": 1000 ** 2, "GB": 1000 ** 3, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
EXIT_UNAVAILABLE = 3


class CgroupUnavailable(RuntimeError):
    """The memory controller cannot be used here (not mounted, not v1, not writable)."""


@dataclass
class CapResult:
    cmd: List[str]
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    limit_bytes: Optional[int]   # None: no cap, the group only measured
    peak_bytes: int              # memory.max_usage_in_bytes
    failcnt: int                 # memory.failcnt: times the limit was reached
    oom_kills: int               # memory.oom_control oom_kill (0 where the kernel lacks it)
    major_faults: int            # memory.stat pgmajfault: pages read back in (the cap made it thrash)
    cold: bool                   # page cache dropped before the run

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def parse_size(text: str) -> int:
    """'560MiB', '1.5GiB', '4096' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 560MiB, 1GiB, 4096)")
    return int(float(m.group(1)) * UNITS[m.group(2).upper()])


def unavailable_reason(root: Path = ROOT) -> Optional[str]:
    """None when memory cgroups can be made under root, else why not."""
    if not (root / "memory.limit_in_bytes").is_file():
        return f"no cgroup-v1 memory controller mounted at {root}"
    if os.geteuid() != 0 or not os.access(root, os.W_OK):
        return f"{root} is not writable (needs root)"
    return None


def drop_caches() -> None:
    """sync, then drop the page cache, dentries and inodes (needs root)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        raise CgroupUnavailable(f"cannot drop caches: {e}") from None


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _oom_kills(group: Path) -> int:
    try:
        for line in (group / "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _stat(group: Path, key: str) -> int:
    """A counter of the group's memory.stat (0 when absent)."""
    try:
        for line in (group / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _make_group(root: Path, limit: Optional[int]) -> Path:
    group = root / f"flashllm_bench_{os.getpid()}_{time.monotonic_ns()}"
    group.mkdir()
    try:
        if limit is not None:
            (group / "memory.limit_in_bytes").write_text(f"{limit}\n")
    except OSError:
        group.rmdir()
        raise
    return group


def _remove_group(group: Path) -> None:
    """rmdir once the group is empty; leftover page-cache charges move to the parent."""
    for _ in range(50):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)
    print(f"warning: could not remove {group}", file=sys.stderr)


def run_capped(cmd: Sequence[str], limit: Optional[int] = None, cold: bool = False,
               env: Optional[Dict[str, str]] = None, timeout: Optional[float] = None,
               cwd: Optional[str] = None, root: Path = ROOT) -> CapResult:
    """Run cmd in a new memory cgroup capped at limit bytes (None: uncapped, measured only)."""
    reason = unavailable_reason(root)
    if reason:
        raise CgroupUnavailable(reason)
    if cold:
        drop_caches()
    group = _make_group(root, limit)
    procs = str(group / "cgroup.procs")

    def enter() -> None:  # runs in the child between fork and exec
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    t0 = time.perf_counter()
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, env=env, cwd=cwd,
                              timeout=timeout, preexec_fn=enter)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        code = -1
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or ""))
        err += f"\ntimeout after {timeout:.0f} s"
    wall = time.perf_counter() - t0
    try:
        return CapResult(cmd=list(cmd), returncode=code, stdout=out, stderr=err, wall_s=wall,
                         limit_bytes=limit, peak_bytes=_read_int(group / "memory.max_usage_in_bytes"),
                         failcnt=_read_int(group / "memory.failcnt"), oom_kills=_oom_kills(group),
                         major_faults=_stat(group, "pgmajfault"), cold=cold)
    finally:
        _remove_group(group)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", help="memory cap, e.g. 560MiB (default: none, measure only)")
    ap.add_argument("--cold", action="store_true", help="sync and drop the page cache first")
    ap.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("no command given (put it after --)")
    limit = parse_size(args.limit) if args.limit else None
    try:
        res = run_capped(cmd, limit, cold=args.cold)
    except CgroupUnavailable as e:
        print(f"cgroup_run: skipped: {e}", file=sys.stderr)
        sys.exit(EXIT_UNAVAILABLE)
    if args.json:
        print(json.dumps(asdict(res)))
    else:
        sys.stdout.write(res.stdout)
        sys.stderr.write(res.stderr)
        cap = f"{res.limit_bytes / 2**20:.0f} MiB" if res.limit_bytes else "none"
        print(f"cgroup_run: exit {res.returncode}, cap {cap}, peak {res.peak_bytes / 2**20:.1f} MiB, "
              f"failcnt {res.failcnt}, major faults {res.major_faults}, oom kills {res.oom_kills}, "
              f"{res.wall_s:.1f} s", file=sys.stderr)
    sys.exit(res.returncode if res.returncode >= 0 else 128 - res.returncode)


if __name__ == "__main__":
    main()
