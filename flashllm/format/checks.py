"""Field and file checks the reader (format/reader.py) validates a manifest with, and the check
of the optional down.bin section (a native conversion's FFN down matrices as the source stores
them)."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from flashllm.errors import FormatError
from flashllm.format.layout import DOWN_ALIGN, MANIFEST_FILE, fits, tensor_nbytes
from flashllm.model.config import ModelConfig


def get(d: dict, key: str, typ: type | tuple, where: str):
    """d[key], which must be of type typ (bool is not an int here); FormatError naming where."""
    v = d.get(key) if isinstance(d, Mapping) else None
    ok = isinstance(v, typ) and not (isinstance(v, bool) and typ in (int, (int, type(None))))
    if not ok:
        raise FormatError(f"{where}: field {key!r} missing or not {getattr(typ, '__name__', typ)}")
    return v


def nat(d: dict, key: str, where: str) -> int:
    v = get(d, key, int, where)
    if v < 0:
        raise FormatError(f"{where}: field {key!r} is negative ({v})")
    return v


def file_size(path: Path, want: int) -> None:
    try:
        size = path.stat().st_size
    except OSError:
        raise FormatError(f"{path}: missing") from None
    if size != want:
        raise FormatError(f"{path}: {size} bytes, the manifest says {want} (truncated or corrupt)")


def side_file(path: Path, entry: dict, where: str) -> Path:
    """entry["file"]: a plain file name inside the model folder."""
    name = get(entry, "file", str, where)
    if Path(name).name != name or name in ("", ".", ".."):
        raise FormatError(f"{where}: file {name!r} is not a plain file name")
    return path / name


def check_down_rows(path: Path, m: dict, cfg: ModelConfig) -> list[dict] | None:
    """The down.bin entries, one per layer: (d_model, n_ff) in a dtype whose rows hold n_ff
    values, page-aligned, inside the file; None when the folder has none (older folders)."""
    entry = m.get("down_rows")
    if entry is None:
        return None
    where = f"{path / MANIFEST_FILE} down_rows"
    file, size = side_file(path, entry, where), nat(entry, "nbytes", where)
    layers = get(entry, "layers", list, where)
    if len(layers) != cfg.n_layers:
        raise FormatError(f"{where}: {len(layers)} layers listed, the config has {cfg.n_layers}")
    end, shape = 0, [cfg.d_model, cfg.n_ff]
    for i, t in enumerate(layers):
        w = f"{where}.layers[{i}]"
        off, nb, dt = nat(t, "offset", w), nat(t, "nbytes", w), get(t, "dtype", str, w)
        nat(t, "crc32", w)
        if t.get("shape") != shape or not fits(dt, cfg.n_ff) or nb != tensor_nbytes(dt, shape):
            raise FormatError(f"{w}: {dt} {t.get('shape')} ({nb} bytes) is not a down matrix "
                              f"{shape}")
        if off % DOWN_ALIGN or off < end or off + nb > size:
            raise FormatError(f"{w}: at {off} it is misaligned, overlapping or outside "
                              f"{file.name} ({size} bytes)")
        end = off + nb
    file_size(file, size)
    return layers
