"""One calibration of a folder at a time, and a failed one remembered.

A calibration rewrites the folder's FFN file and manifest (sparsity/reorder.py), so two at once
on one folder would race: `hold(path, log)` takes an exclusive lock beside the folder (the
conversion's own lock file, `.NAME.lock`, which `run` holds while it converts and calibrates),
saying once that it waits when another process holds it.

A calibration that failed (its child OOM-killed, an error) is recorded beside the folder, never
inside it, in `.NAME.calibration.json` (written atomically): its reason, the DRAM budget it had
and the manifest it failed on. `run` reads it and does not try again with the same or a smaller
budget on the same conversion; a successful calibration removes it.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Optional

from flashllm.limits import loads_json

Log = Callable[[str], None]


def lock_path(folder: Path) -> Path:
    """The lock of a converted folder: the one resolve_model's conversion takes."""
    return folder.parent / f".{folder.name}.lock"


def failure_path(folder: Path) -> Path:
    """Where a failed calibration of folder is recorded (beside it)."""
    return folder.parent / f".{folder.name}.calibration.json"


def hold(folder: Path, log: Log):
    """Exclusive use of folder for a calibration: waits (saying so once) while another
    process holds it."""
    from flashllm.format.lock import exclusive
    return exclusive(lock_path(Path(folder)), log,
                     f"waiting: another process is converting or calibrating {folder}")


def _manifest_sha(folder: Path) -> Optional[str]:
    try:
        return hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()
    except OSError:
        return None


def record_failure(folder: Path, reason: str, budget: Optional[int]) -> None:
    """Remember that calibrating folder failed for reason with budget bytes of DRAM (None: no
    budget), atomically (a temporary name, then a rename)."""
    path = failure_path(Path(folder))
    entry = {"reason": reason, "dram_budget": budget, "when": time.strftime("%Y-%m-%d %H:%M"),
             "manifest_sha256": _manifest_sha(Path(folder))}
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(entry) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError:           # remembering is a courtesy: the run goes on without it
        tmp.unlink(missing_ok=True)


def known_failure(folder: Path, budget: Optional[int]) -> Optional[dict]:
    """The recorded failure that still holds for folder with budget bytes (None: no budget):
    same manifest, and a budget no larger than the failed one's; else None."""
    try:
        entry = loads_json(failure_path(Path(folder)).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("manifest_sha256") != _manifest_sha(Path(folder)):
        return None
    failed = entry.get("dram_budget")
    if failed is not None and (budget is None or budget > failed):
        return None           # more memory now: worth another try
    return entry


def clear_failure(folder: Path) -> None:
    failure_path(Path(folder)).unlink(missing_ok=True)
