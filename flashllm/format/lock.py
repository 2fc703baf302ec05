"""One process at a time on a converted folder: an advisory lock file beside it, which a
process that waits says it waits for, and which is removed when released (a bad GGUF leaves no
lock behind in the cache)."""
from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Callable, Iterator, Optional

from flashllm.errors import FormatError


@contextlib.contextmanager
def exclusive(path: Path, log: Optional[Callable[[str], None]] = None,
              waiting: str = "", busy: Optional[str] = None) -> Iterator[None]:
    """Hold the exclusive lock of path for the with block. When another process holds it,
    log(waiting) once, then wait; with busy, do not wait: FormatError(busy). The holder removes
    the file before it lets go, so a process that waited on the removed file locks the new one
    instead (it checks the inode it holds is still the one at path)."""
    said = False
    while True:
        f = _open(Path(path))
        try:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if busy is not None:
                    raise FormatError(busy) from None
                if log is not None and not said:
                    log(waiting or f"waiting for another flashllm process ({path})")
                    said = True
                fcntl.flock(f, fcntl.LOCK_EX)
            if _same_file(path, f):
                break
        except BaseException:
            f.close()
            raise
        f.close()                                 # removed while this one waited: again
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def _open(path: Path):
    """The lock file, its folder made if need be; FormatError naming the folder if it cannot be."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "a")
    except OSError as e:
        raise FormatError(f"cannot write in {path.parent}: {e.strerror or e}") from None


def _same_file(path: Path, f) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
    except OSError:
        return False
