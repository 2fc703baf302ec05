"""Atomic writes of a flash model folder's files: fsync'd files and folders, the manifest's
sections replaced in place (update_manifest), a converted folder's files put in place of an
older conversion's while the user's own files stay (replace_own_files), and the temporary
folders of killed writers swept.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterable, Optional

from flashllm.limits import loads_json
from flashllm.errors import FormatError
from flashllm.format.integrity import STAMP
from flashllm.format.layout import MANIFEST_FILE
from flashllm.format.manifest import read_manifest
from flashllm.format.reader import FlashModel

REPLACING = ".replacing.json"     # the names flashllm owns in a folder whose files it is replacing
_TEMPORARY = re.compile(r"\..+\.tmp-[0-9]+")   # a killed writer's file (update_manifest, ...)


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



def switch(path: Path, stale: Iterable[str], **sections: dict) -> None:
    """The manifest's sections replaced in one atomic rename (update_manifest: the files they
    name are complete and fsync'd), then the stale files (named by the old sections only)
    removed. Killed before the rename, the folder is the old one; after it, the new one (stale
    files left behind are swept by the next calibration: sparsity/reorder.sweep_temporaries)."""
    update_manifest(path, **sections)
    for name in stale:
        (Path(path) / name).unlink(missing_ok=True)


def free_name(current: Optional[str], names: tuple[str, str]) -> str:
    """The one of a file's two names that the manifest does not use now (current: the one it
    names, or None), so a new file is written beside the old one until switch."""
    return names[1] if current == names[0] else names[0]

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


def check_target(out: Path, force: bool) -> None:
    """An existing output may only be a flash model folder (or one whose replacement was
    interrupted), and only with force are its flashllm files replaced (own_files): a file, a
    link, any other folder and any file flashllm did not write are never touched."""
    if not (out.exists() or out.is_symlink()):
        return
    if not force:
        raise FormatError(f"{out} already exists (use --force to replace it)")
    if out.is_symlink() or not out.is_dir():
        raise FormatError(f"{out} is not a flash model folder: --force replaces only a "
                          "converted model, never a file")
    if (out / REPLACING).is_file() and not (out / MANIFEST_FILE).exists():
        return                           # a replacement interrupted before its manifest went in
    try:
        FlashModel(out)
    except FormatError as e:
        raise FormatError(f"{out} is not a flash model folder, so --force will not "
                          f"replace it ({e}); choose another output") from None


def install(new: Path, out: Path, force: bool) -> None:
    """Move the complete, fsync'd folder new to out: renamed, or with force in place of an
    existing conversion's files (replace_own_files); FormatError naming any file of the user's
    the new one would overwrite."""
    if not (out.exists() or out.is_symlink()):
        os.rename(new, out)
    else:
        check_target(out, force)
        own = own_files(out)
        clash = sorted(n.name for n in new.iterdir()
                       if n.name not in own and os.path.lexists(out / n.name))
        if clash:
            raise FormatError(f"{out} holds {', '.join(clash)}, which flashllm did not write and "
                              "the new conversion would overwrite: move them away")
        replace_own_files(new, out, out.parent / f".{out.name}.old-{os.getpid()}")
    fsync_dir(out.parent)


def own_files(folder: Path) -> set[str]:
    """The names in folder that flashllm wrote: the manifest, every file it names (at any depth),
    the checksum stamp, temporaries of killed writers, and what an interrupted replacement
    listed (REPLACING). Anything else is the user's."""
    names = {MANIFEST_FILE, STAMP, REPLACING}
    names |= {p.name for p in folder.iterdir() if _TEMPORARY.fullmatch(p.name)}
    try:
        names |= named_files(read_manifest(folder, validate=False).to_dict())
    except FormatError:
        pass
    try:
        names |= {n for n in loads_json((folder / REPLACING).read_text(encoding="utf-8"))
                  if isinstance(n, str)}
    except (OSError, ValueError, TypeError):
        pass
    return {n for n in names if n and "/" not in n and n not in (".", "..")}


def named_files(section) -> set[str]:
    """Every "file" value of a manifest's sections, at any depth."""
    if isinstance(section, list):
        return set().union(*map(named_files, section)) if section else set()
    if not isinstance(section, dict):
        return set()
    found = {section["file"]} if isinstance(section.get("file"), str) else set()
    return found.union(*map(named_files, section.values()))


def replace_own_files(new: Path, out: Path, trash: Path) -> None:
    """Put the complete, fsync'd files of folder new in place of the flashllm files of folder out
    (own_files), leaving every other entry of out as it is; new is removed.

    The manifest goes first out and last in: a folder interrupted on the way has no manifest,
    so it does not look like a model, and its REPLACING list names every file flashllm has in
    it, so a later replacement (own_files) finishes the job. Old files go to trash (a new
    folder, swept by sweep_leftovers if this process is killed)."""
    names = sorted(p.name for p in new.iterdir())
    own = own_files(out) - {REPLACING}
    _write_synced(out / REPLACING, json.dumps(sorted(own | set(names))).encode())
    trash.mkdir(exist_ok=True)      # a replacement this process began and was interrupted in
    for name in [MANIFEST_FILE] + sorted(own - {MANIFEST_FILE}):
        if os.path.lexists(out / name):
            os.rename(out / name, trash / name)
    fsync_dir(out)
    for name in names:
        if name != MANIFEST_FILE:
            os.rename(new / name, out / name)
    fsync_dir(out)
    os.rename(new / MANIFEST_FILE, out / MANIFEST_FILE)
    fsync_dir(out)
    (out / REPLACING).unlink()
    fsync_dir(out)
    shutil.rmtree(trash, ignore_errors=True)
    new.rmdir()


def _write_synced(file: Path, data: bytes) -> None:
    """file's content replaced by data atomically (temporary file, fsync, rename)."""
    tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        sync_close(f)
    os.rename(tmp, file)
