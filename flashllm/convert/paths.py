"""What a path the user gave must be before anything reads it (light: resolving a converted folder
imports no converter)."""
from __future__ import annotations

import stat
from pathlib import Path

from flashllm.errors import SourceError


def check_path(path: Path) -> None:
    """SourceError (one line) unless path is a regular file or a folder: missing, a symlink loop,
    unreadable, or a FIFO, device or socket (reading one would wait forever)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise SourceError(f"{path}: no such file or folder") from None
    except OSError as e:                     # ELOOP: a symlink loop; EACCES ...
        raise SourceError(f"{path}: {e.strerror or e}") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise SourceError(f"{path}: not a regular file or folder (a FIFO, device or socket)")
