"""Atomic writes of a flash model folder's files: fsync'd files and folders, the manifest's
sections replaced in place (update_manifest), and the temporary folders of killed writers swept.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from flashllm.errors import FormatError
from flashllm.format.layout import MANIFEST_FILE
from flashllm.format.manifest import read_manifest


def update_manifest(path: Path, **sections: dict) -> None:
    """Replace the reserved manifest sections (`sparsity`, `predictor`) of the model folder at path,
    or its `ffn` section (a hot-first rewrite), atomically (temporary file, fsync, rename). Side
    files they name must already be complete and fsync'd in the folder."""
    unknown = set(sections) - {"sparsity", "predictor", "ffn"}
    if unknown:
        raise FormatError(f"manifest sections {sorted(unknown)} cannot be updated")
    file = Path(path) / MANIFEST_FILE
    tmp = file.with_name(f".{MANIFEST_FILE}.tmp-{os.getpid()}")
    try:
        manifest = read_manifest(path).to_dict()
        manifest.update(sections)
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(manifest, indent=1) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, file)
        fsync_dir(file.parent)
    except (OSError, ValueError) as e:
        tmp.unlink(missing_ok=True)
        raise FormatError(f"cannot update {file}: {e}") from None


def sync_close(f) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def why(e: OSError) -> str:
    return e.strerror or str(e)


def sweep_leftovers(out: Path) -> None:
    """Remove the temporary folders (.NAME.tmp-PID, .NAME.old-PID) that writers of out left when
    they were killed: those whose process is gone."""
    for p in out.parent.glob(f".{out.name}.*-*"):
        kind, _, pid = p.name[len(out.name) + 2:].partition("-")
        if kind not in ("tmp", "old") or not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:        # someone else's process
        return True
    return True
