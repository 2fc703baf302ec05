"""What the user typed after `run` (or `inspect`, `calibrate` ...) as a converted flashllm folder:
a folder given directly, a GGUF file (converted once into the user cache, as llama.cpp users
pass their file), or a models.toml name, pulled and converted once into the user cache."""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Optional

from flashllm.convert.registry import Log, load_registry, pull
from flashllm.errors import FlashError, RegistryError


def resolve_model(model: str, cache_dir: Path, registry_path: Path, log: Log,
                  dtype: Optional[str] = None, apart: bool = False) -> Path:
    """A converted flashllm folder for MODEL: a folder given directly, a GGUF file (converted
    once into cache_dir/converted/STEM-KEY-DTYPE, KEY naming the file's path, size and time),
    or a models.toml name (fetched and converted once into cache_dir/converted/NAME-DTYPE).
    With `apart`, a conversion runs in a child process, so its memory never counts in this
    one's (a run under --dram-budget measures its own size to plan)."""
    path = Path(model)
    if os.path.lexists(path):               # a path the user gave: a file or folder to read
        from flashllm.convert.paths import check_path
        check_path(path)
    if path.is_dir() and (path / "manifest.json").is_file():
        return _told(path, log)
    if path.is_file() and _is_gguf(path):                # by content, as convert decides
        out = gguf_conversion(path, cache_dir, dtype or "native")
        if not _current(out):
            _convert_once(path.name, path, out, dtype or "native", log, apart)
        return _told(out, log)
    if path.exists():
        raise RegistryError(_not_converted(path))
    registry = load_registry(registry_path)
    if model not in registry.entries:
        raise RegistryError(f"no such model {model!r}: not a converted model folder, nor a file, "
                            f"nor a models.toml name (known: {', '.join(registry.names())})")
    entry = registry.get(model)
    if entry.unsupported:
        raise RegistryError(f"{entry.name}: {entry.unsupported}")
    dtype = dtype or entry.default_dtype
    out = Path(cache_dir) / "converted" / f"{entry.name}-{dtype}"
    if not _current(out):
        _convert_once(entry.name, pull(entry, cache_dir, log), out, dtype, log, apart)
    return _told(out, log)


def gguf_conversion(gguf: Path, cache_dir: Path, dtype: str) -> Path:
    """Where `run FILE.gguf` keeps its conversion of that file: a new folder when the file is
    another (other path, size or modification time), so an edited file is never run stale."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()
    return Path(cache_dir) / "converted" / f"{gguf.stem}-{key[:10]}-{dtype}"


def _current(out: Path) -> bool:
    return (out / "manifest.json").is_file() and _stale(out) is None


def _stale(out: Path) -> str | None:
    """Why the cached conversion at out is made again: another recipe than this flashllm's
    (recipe.outdated), or the recipe before (recipe.coarser) while nothing was calibrated in it
    (converting again takes a minute; a calibration an hour: that folder is kept, and said)."""
    why = conversion_outdated(out)
    if why is None and not _calibrated_in(out):
        why = conversion_outdated(out, coarser=True)
    return why


def _calibrated_in(out: Path) -> bool:
    """Whether calibrate wrote anything into the conversion at out (thresholds, an order, a
    predictor); an unreadable manifest: True, left to the reader to report."""
    from flashllm.format.manifest import read_manifest
    try:
        m = read_manifest(out)
        return bool(m.get("sparsity") or m.get("predictor") or m["ffn"].get("neuron_order"))
    except (FlashError, KeyError, TypeError):
        return True


def _convert_once(name: str, gguf: Path, out: Path, dtype: str, log: Log, apart: bool) -> None:
    """Convert the GGUF file of `name` into out, unless another process did while this one
    waited."""
    with locked(out.parent / f".{out.name}.lock", log,   # one conversion at a time: a second
                f"{name}: waiting for another flashllm process converting it to {out}"):
        if (out / "manifest.json").is_file():            # run waits, then uses the first's
            why = _stale(out)
            if why is None:
                return
            log(f"{name}: {out} was converted by an older flashllm ({why}): converting again")
        if out.exists():                 # our own leftover or older conversion, not the user's
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        log(f"{name}: converting to {out} ({dtype}, once"
            + (", in a child process outside the DRAM budget)" if apart else ")"))
        if apart:
            in_child(_convert_work, (str(gguf), str(out), dtype, name), f"converting {name}")
        else:
            _convert_work(str(gguf), str(out), dtype, name, log)


def _told(out: Path, log: Log) -> Path:
    """out, after one line on log when it is a conversion of the recipe before, kept rather than
    made again (recipe.coarser: its calibration may have taken an hour)."""
    why = conversion_outdated(out, coarser=True)
    if why is not None:
        log(f"{out}: {why}")
    return out


def conversion_outdated(out: Path, coarser: bool = False) -> str | None:
    """Why the converted folder at out is not what this flashllm makes (recipe.outdated), or
    None; an absent or unreadable manifest is left to the reader to report. With coarser, only
    what a conversion of the recipe before lacks (recipe.coarser)."""
    from flashllm.convert import recipe
    from flashllm.format.manifest import read_manifest
    try:
        return (recipe.coarser if coarser else recipe.outdated)(read_manifest(out))
    except (FlashError, KeyError, TypeError):
        return None


def in_child(work: Callable, args: tuple, what: str) -> None:
    """work(*args, log) in a spawned child process logging to stderr; its error (a
    FlashError's line) is raised here."""
    import multiprocessing   # ~1 MiB a run that only reads would count in its --dram-budget
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(work, args, what, send),
                        name="flashllm-" + what.split()[0])
    child.start()
    send.close()
    try:
        said = receive.recv()                  # None when done, else the error's line
    except EOFError:                           # the child died without a word
        child.join()
        said = f"{what} stopped (exit code {child.exitcode})"
    finally:
        child.join(timeout=5)                  # it ends right after its last word
        if child.is_alive():
            child.terminate()
        receive.close()
    if said is not None:
        raise FlashError(said)


def _child(work: Callable, args: tuple, what: str, send) -> None:
    """The child of in_child: runs work, logging to stderr, and says how it ended."""
    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)
    try:
        work(*args, log)
        send.send(None)
    except FlashError as e:
        send.send(str(e))
    except OSError as e:         # a file the work did not name (a full disk, a read-only cache)
        send.send(f"{what}: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""))
    except KeyboardInterrupt:
        send.send(f"{what} was interrupted")


def _convert_work(gguf: str, out: str, dtype: str, name: str, log: Log) -> None:
    from flashllm.convert.convert import convert
    convert(Path(gguf), Path(out), dtype, progress=_tenths(name, log))


def locked(path: Path, log: Optional[Log] = None, waiting: str = ""):
    """An exclusive advisory lock on path, held for the with block (format/lock.exclusive)."""
    from flashllm.format.lock import exclusive
    return exclusive(path, log, waiting)


def _tenths(name: str, log: Log) -> Callable[[int, int], None]:
    """A convert progress callback that logs each further 10% done."""
    shown = [0]

    def progress(done: int, total: int) -> None:
        tenth = 10 * done // max(total, 1)
        if tenth > shown[0]:
            shown[0] = tenth
            log(f"{name}: converted {10 * tenth}%")

    return progress


def _head(path: Path) -> bytes:
    """The first 4 bytes of a file (fewer when it is shorter)."""
    with open(path, "rb") as f:
        return f.read(4)


def _is_gguf(path: Path) -> bool:
    from flashllm.convert.sources.base import GGUF_MAGIC   # not imported to run a converted folder
    return _head(path) == GGUF_MAGIC


def _not_converted(path: Path) -> str:
    if path.is_dir() and (path / "config.json").is_file():
        return (f"{path} is a Hugging Face checkpoint folder, not a converted model: run "
                f"`flashllm convert {path} -o OUT` first")
    if path.is_file():
        return (f"{path} is not a GGUF file (it starts {_head(path)!r}, a GGUF file b'GGUF') "
                f"nor a converted model folder")
    return (f"{path} is not a converted flashllm model (no manifest.json); "
            f"convert a GGUF file or Hugging Face folder with `flashllm convert SRC -o OUT`")
