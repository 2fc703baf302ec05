"""A GGUF file's header read lean: metadata as plain Python values and the tensor table as views of
one read-only map of the file (GGUFFile).

gguf-py's GGUFReader makes a numpy view of every string of the vocabulary (tokens and merges: four
arrays of ~100 bytes each per entry), 490 MiB of Python objects for a 152k-token vocabulary; this
reader decodes each array into one list as it goes (~20 MiB for the same file) and keeps nothing
else. Tensor data is never copied: each tensor's `data` is a view of the map, shaped as gguf-py
shapes it ((rows, bytes per row) uint8 for a block type, (rows, cols) of the float or int type
for F16 / F32 / F64 / I8 .. I64), so its pages are file cache, not the process's own memory.
Little-endian files (versions 2 and 3) only.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

DEFAULT_ALIGNMENT = 32
# GGUFValueType code -> struct format of a scalar (STRING 8 and ARRAY 9 are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_PLAIN = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}
STRING, ARRAY = 8, 9
# What the header may make this process hold, as Python objects: a string its bytes and ~64
# more, an array item ~32 (an int or float and its pointer), a tensor ~512 (its entry and
# views). Qwen2.5's 152k-token vocabulary costs ~27 MiB, Gemma 3's 262k ~35 MiB; a hostile file
# is refused at this bound, not when memory runs out (a float array decodes to 8x its bytes).
MAX_HEADER_OBJECTS = 512 << 20
STR_COST, ITEM_COST, TENSOR_COST = 64, 32, 512


class HeaderTooLarge(ValueError):
    """A header whose metadata or tensor table would take more than MAX_HEADER_OBJECTS."""


@dataclass
class GGUFTensor:
    """One tensor of the table, with the attributes of gguf-py's ReaderTensor that flashllm reads."""
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray           # ggml order (cols, rows, ...), uint64
    n_bytes: int
    data_offset: int
    data: np.ndarray            # a view of the map: (rows, bytes per row) uint8, or (rows, cols)


class GGUFFile:
    """The header of a GGUF file: `fields` (key -> str, int, float, bool or a list of them, in
    file order), `types` (key -> GGUFValueType code; for an array, its items'), `tensors`."""

    def __init__(self, path: Path):
        self._map = np.memmap(path, mode="r")                              # (file bytes,) uint8
        self._at, self._held = 0, 0
        magic, version, n_tensors, n_kv = self._unpack("<4sIQQ")
        if magic != b"GGUF":
            raise ValueError(f"bad magic {magic!r}")
        if version not in (2, 3):
            raise ValueError(f"unknown GGUF version {version}")
        self.fields: dict = {}
        self.types: dict[str, int] = {}
        for _ in range(n_kv):
            self._hold(2 * ITEM_COST, "the metadata")       # its entries in fields and types
            key = self._string()
            if key in self.fields:
                raise ValueError(f"duplicate metadata key {key}")
            self.fields[key] = self._value(key, self._unpack("<I")[0])
        infos = []
        for _ in range(n_tensors):
            self._hold(TENSOR_COST, "the tensor table")
            infos.append(self._tensor_info())
        align = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if self.types.get("general.alignment", 4) != 4 or align <= 0 or align & (align - 1):
            raise ValueError(f"bad general.alignment {align!r}")
        start = -(-self._at // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, self._map, self._at)
        self._at += struct.calcsize(fmt)
        return out

    def _hold(self, cost: int, what: str) -> None:
        """Count cost bytes more of Python objects made from the header; HeaderTooLarge past
        MAX_HEADER_OBJECTS."""
        self._held += cost
        if self._held > MAX_HEADER_OBJECTS:
            raise HeaderTooLarge(f"{what} would take more than {MAX_HEADER_OBJECTS >> 20} MiB "
                                 "of memory to read, more than any model's header")

    def _string(self, what: str = "a string") -> str:
        n, = self._unpack("<Q")
        if self._at + n > len(self._map):
            raise ValueError("a string runs past the end of the file")
        self._hold(n + STR_COST, what)
        s = self._map[self._at:self._at + n].tobytes().decode("utf-8")
        self._at += n
        return s

    def _value(self, key: str, kind: int):
        self.types[key] = kind
        if kind == STRING:
            return self._string()
        if kind in _SCALARS:
            v, = self._unpack(_SCALARS[kind])
            return v
        if kind != ARRAY:
            raise ValueError(f"metadata {key}: unknown value type {kind}")
        item, n = self._unpack("<IQ")
        self.types[key] = item
        if item == STRING:
            if n > (len(self._map) - self._at) // 8:
                raise ValueError(f"metadata {key}: {n} strings cannot fit the file")
            return [self._string(f"metadata {key}") for _ in range(n)]
        if item not in _NUMPY:
            raise ValueError(f"metadata {key}: arrays of type {item} are unsupported")
        size = n * np.dtype(_NUMPY[item]).itemsize
        if self._at + size > len(self._map):
            raise ValueError(f"metadata {key}: the array runs past the end of the file")
        self._hold(n * ITEM_COST, f"metadata {key}")
        values = np.frombuffer(self._map, _NUMPY[item], n, self._at).tolist()
        self._at += size
        return values

    def _tensor_info(self) -> tuple:
        name = self._string()
        n_dims, = self._unpack("<I")
        if n_dims > 8:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        dims = self._unpack(f"<{n_dims}Q")
        kind, offset = self._unpack("<IQ")
        return name, dims, GGMLQuantizationType(kind), offset

    def _tensor(self, start: int, name: str, dims: tuple, kind, offset: int) -> GGUFTensor:
        n = int(np.prod(dims, dtype=object))
        block, type_size = GGML_QUANT_SIZES[kind]
        n_bytes, at = n * type_size // block, start + offset
        shape = tuple(reversed(dims))                                      # numpy order
        if kind in _PLAIN:
            count, dtype = n, _PLAIN[kind]
        else:
            count, dtype, shape = n_bytes, np.uint8, quant_shape_to_byte_shape(shape, kind)
        if at + n_bytes > len(self._map):
            data = self._map[:0]        # _read in gguf.py reports the truncation by n_bytes
        else:
            data = self._map[at:at + n_bytes].view(dtype)[:count].reshape(shape)
        return GGUFTensor(name, kind, np.array(dims, dtype=np.uint64), n_bytes, at, data)
