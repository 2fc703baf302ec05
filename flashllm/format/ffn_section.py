"""A flash folder's FFN section (docs/FORMAT.md, "ffn.bin"): its layout as the runtime reads it
(FfnLayout) and the checks open_flash runs on it before use (check_ffn): the manifest's fields,
per-layer strides and down dtypes, the regions' alignment, ffn.bin's header and the neuron order.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flashllm.errors import FormatError
from flashllm.format.checks import file_size as _file_size, get as _get, nat as _nat, \
    side_file as _side_file
from flashllm.format.layout import (DTYPE_CODES, EXPERT_ROWS, FFN_ALIGN, FFN_HEADER, FFN_MAGIC,
                                    MANIFEST_FILE, STRIDE_ALIGN, align_up, expert_rows_version,
                                    ffn_part_bytes, ffn_parts, fits)
from flashllm.model.config import ModelConfig
from flashllm.model.tensor import DOWN_DTYPES, companion, row_bytes


@dataclass(frozen=True)
class FfnLayout:
    file: Path
    dtype: str
    glu: bool
    d_model: int
    n_ff: int                         # bundle slots per layer (ModelConfig.ffn_slots)
    part_bytes: int                   # row_bytes(dtype, d_model): one gate / up part
    stride: int                       # bytes per bundle slot of the widest layer (buffers that
                                      # serve any layer); each layer's own: strides
    layer_offsets: list[int]          # byte offset of each layer's region in ffn.bin (4096-aligned)
    layer_crc32: list[int]
    neuron_order: np.ndarray | None   # (n_layers, n_ff) int32, slot j holds neuron order[l, j]; None: j
    down_dtype: str                   # the manifest's down dtype (companion(dtype) in older folders)
    strides: tuple[int, ...]          # per layer: bytes per bundle slot (parts + padding)
    down_dtypes: tuple[str, ...]      # per layer: the down column's dtype (with expert_rows:
                                      # the down rows')
    expert_rows: bool = False         # each expert's slots hold its gate, up and down rows as
                                      # the source stores them (EXPERT_ROWS), not bundles

    @property
    def down_offset(self) -> int:
        """Bytes of a bundle before its down column: the gate and up rows (up only, no GLU)."""
        return (2 if self.glu else 1) * self.part_bytes

    @property
    def uniform(self) -> bool:
        """Every layer has the same stride and down dtype (all folders before per-layer ones)."""
        return len(set(self.strides)) == 1 and len(set(self.down_dtypes)) == 1

    def layer_nbytes(self, layer: int) -> int:
        """n_ff * the layer's stride: bytes of its bundles."""
        return self.n_ff * self.strides[layer]


def check_ffn(path: Path, m: dict, cfg: ModelConfig) -> FfnLayout:
    """The manifest's `ffn` section of the folder at path, checked against cfg, ffn.bin's size
    and header and the neuron order file: its FfnLayout."""
    where, f = f"{path / MANIFEST_FILE} ffn", m["ffn"]
    dtype = _get(f, "dtype", str, where)
    rows = _expert_rows(f, m, cfg, where)
    down = f.get("down_dtype", companion(dtype) if dtype in DTYPE_CODES else dtype)
    if not fits(dtype, cfg.d_model) or not _down_fits(down, cfg, rows):
        raise FormatError(f"{where}: dtype {dtype!r} / down_dtype {down!r} cannot store rows of "
                          f"d_model={cfg.d_model}")
    want = {"glu": cfg.glu, "d_model": cfg.d_model, "n_ff": cfg.ffn_slots, "n_layers": cfg.n_layers,
            "part_bytes": row_bytes(dtype, cfg.d_model),
            "parts": list(ffn_parts(cfg.glu))}
    for key, value in want.items():
        if f.get(key) != value:
            raise FormatError(f"{where}: {key}={f.get(key)!r}, the config needs {value!r}")
    file = _side_file(path, f, where)      # ffn.bin, or the file a hot-first rewrite made
    stride, layer_bytes, size = (_nat(f, k, where) for k in ("stride", "layer_bytes", "nbytes"))
    layers = _get(f, "layers", list, where)
    if len(layers) != cfg.n_layers:
        raise FormatError(f"{where}: {len(layers)} layers listed, the config has {cfg.n_layers}")
    strides, downs = _layer_strides(layers, cfg, dtype, (stride, layer_bytes, down), where, rows)
    offsets = [_nat(e, "offset", f"{where}.layers[{i}]") for i, e in enumerate(layers)]
    crcs = [_nat(e, "crc32", f"{where}.layers[{i}]") for i, e in enumerate(layers)]
    end = FFN_ALIGN
    for i, (e, off, s) in enumerate(zip(layers, offsets, strides)):
        region = layer_bytes if s == stride else align_up(cfg.ffn_slots * s, FFN_ALIGN)
        if e.get("nbytes") != cfg.ffn_slots * s or off % FFN_ALIGN or off < end \
                or off + region > size:
            raise FormatError(f"{where}.layers[{i}]: region at {off} is misaligned, overlapping or "
                              f"outside {file.name} ({size} bytes)")
        end = off + region
    _check_ffn_header(file, size, (DTYPE_CODES[dtype], int(cfg.glu), cfg.n_layers,
                      cfg.d_model, cfg.ffn_slots, want["part_bytes"], stride, layer_bytes, size),
                      m["format_version"])
    return FfnLayout(file, dtype, cfg.glu, cfg.d_model, cfg.ffn_slots, want["part_bytes"], stride,
                     offsets, crcs, _read_order(path, f.get("neuron_order"), cfg), down,
                     tuple(strides), tuple(downs), rows)


def _expert_rows(f: dict, m: dict, cfg: ModelConfig, where: str) -> bool:
    """Whether the section holds experts as rows (`experts`: "rows"; absent: bundles), which
    needs a mixture of experts without a neuron order, and the format version that says so."""
    rows = f.get("experts") == EXPERT_ROWS
    if "experts" in f and (not rows or not cfg.n_experts or f.get("neuron_order")):
        raise FormatError(f"{where}: experts={f['experts']!r} needs a mixture of experts without "
                          f"a neuron order (and is {EXPERT_ROWS!r} or absent)")
    if m.get("format_version") != expert_rows_version(rows):
        raise FormatError(f"{where}: format version {m.get('format_version')} "
                          f"{'with' if rows else 'without'} expert rows")
    return rows


def _down_fits(down: str, cfg: ModelConfig, rows: bool) -> bool:
    """Whether the down part can be `down`: a bundle's column of d_model values, or with expert
    rows also rows of n_ff (and n_ff_shared) values."""
    if not rows:
        return down in DOWN_DTYPES and fits(down, cfg.d_model)
    return fits(down, cfg.d_model) and fits(down, cfg.n_ff) and \
        (not cfg.n_ff_shared or fits(down, cfg.n_ff_shared))


def _layer_strides(layers: list, cfg: ModelConfig, dtype: str, top: tuple, where: str,
                   rows: bool = False):
    """([stride], [down dtype]) per layer: a layer entry's own `stride` / `down_dtype`, else the
    section's (top: stride, layer_bytes, down_dtype). The widest stride is the section's."""
    stride, layer_bytes, down = top
    strides, downs = [], []
    for i, e in enumerate(layers):
        w = f"{where}.layers[{i}]"
        s = _nat(e, "stride", w) if "stride" in e else stride
        dd = _get(e, "down_dtype", str, w) if "down_dtype" in e else down
        used = sum(ffn_part_bytes(dtype, cfg.d_model, cfg.glu, dd)) \
            if _down_fits(dd, cfg, rows) else None
        if used is None or s < used or s % STRIDE_ALIGN or s > stride:
            raise FormatError(f"{w}: stride {s} / down_dtype {dd!r} do not fit a bundle of "
                              f"d_model={cfg.d_model} (the widest stride is {stride})")
        strides.append(s)
        downs.append(dd)
    if stride not in strides or layer_bytes < cfg.ffn_slots * stride or layer_bytes % FFN_ALIGN:
        raise FormatError(f"{where}: stride {stride} / layer_bytes {layer_bytes} do not fit "
                          f"{cfg.ffn_slots} bundles of the widest layer")
    return strides, downs


def _check_ffn_header(file: Path, size: int, want: tuple, format_version: int) -> None:
    _file_size(file, size)
    with open(file, "rb") as fh:
        raw = fh.read(FFN_HEADER.size)
    if len(raw) < FFN_HEADER.size:
        raise FormatError(f"{file}: truncated header")
    magic, version, header_bytes, *fields = FFN_HEADER.unpack(raw)
    if magic != FFN_MAGIC:
        raise FormatError(f"{file}: bad magic {magic!r} (not a flashllm FFN section)")
    if version != format_version:
        raise FormatError(f"{file}: format version {version}, the manifest's is {format_version}")
    if header_bytes != FFN_ALIGN or tuple(fields) != want:
        raise FormatError(f"{file}: header {tuple(fields)} does not match the manifest {want}")


def _read_order(path: Path, entry, cfg: ModelConfig) -> np.ndarray | None:
    """The hot-first neuron order (n_layers, n_ff) int32, each row a permutation; None if absent."""
    if entry is None:
        return None
    where = f"{path / MANIFEST_FILE} ffn.neuron_order"
    file = _side_file(path, entry, where)
    shape, nbytes = [cfg.n_layers, cfg.ffn_slots], 4 * cfg.n_layers * cfg.ffn_slots
    if (entry.get("dtype"), entry.get("shape"), entry.get("nbytes")) != ("int32", shape, nbytes):
        raise FormatError(f"{where}: expected int32 {shape} ({nbytes} bytes)")
    _file_size(file, entry["nbytes"])
    order = np.fromfile(file, dtype="<i4").reshape(shape)                        # (n_layers, n_ff)
    if not np.array_equal(np.sort(order, axis=1), np.broadcast_to(np.arange(cfg.ffn_slots), shape)):
        raise FormatError(f"{file}: a layer's neuron order is not a permutation of 0..{cfg.ffn_slots - 1}")
    return order.astype(np.int32)
