"""Checksums verified on a model's first load, then remembered.

`flashllm run` (one-shot and chat) checks every crc32 of a model folder the first time it opens
it, and writes a stamp `.verified` holding a fingerprint of the folder: the
manifest's sha256 and each file's name, size and modification time. A later load with the same
fingerprint skips the check; any rewrite of a file changes the fingerprint and brings it back.
A read-only folder is verified on every load.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from flashllm.format.reader import FlashModel

STAMP = ".verified"


def fingerprint(path: Path) -> str:
    """A text that changes whenever any file of the model folder is rewritten."""
    lines = []
    for p in sorted(path.iterdir()):
        if p.is_file() and not p.name.startswith("."):
            st = p.stat()
            lines.append(f"{p.name} {st.st_size} {st.st_mtime_ns}")
    manifest = hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()
    return "\n".join([f"manifest {manifest}", *lines]) + "\n"


def verify_on_first_load(flash: FlashModel) -> bool:
    """flash.verify() unless the folder's stamp matches its fingerprint; True when it checked.
    A checksum mismatch raises FormatError (from verify) and leaves no stamp."""
    path = Path(flash.path)
    stamp = path / STAMP
    key = fingerprint(path)
    try:
        if stamp.read_text(encoding="utf-8") == key:
            return False
    except (OSError, UnicodeDecodeError):
        pass
    flash.verify()
    tmp = path / f"{STAMP}.tmp-{os.getpid()}"
    try:
        tmp.write_text(key, encoding="utf-8")
        os.replace(tmp, stamp)
    except OSError:  # a read-only folder: verify again next time
        tmp.unlink(missing_ok=True)
    return True
