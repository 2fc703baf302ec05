"""Activation predictors: which FFN slots a token needs, computed from the FFN input h.

A predictor holds, per layer, a few small matrices (QTensors, multiplied in C by kernel.matmul)
and one threshold. For each token it computes a score per slot; a slot is predicted active when
its score reaches the layer's threshold. `predict(layer, h)` returns the union over the T tokens.

Kinds (the score of slot j for one token with FFN input h):
  lowrank    b_j + B_j · (A h)            A (r, d), B (n_ff, r), b (n_ff,): the paper's predictor
                                          (a logit; threshold 0 is sigmoid > 0.5)
  gate       |act(G_j · h)|               G (n_ff, d): W_gate resident (CATS-style)
  gate_up    |act(G_j · h) · (U_j · h)|   G, U (n_ff, d): low-bit copies of W_gate and W_up
  gate_lrup  |act(G_j · h) · (Ub_j · (Ua h))|  G (n_ff, d), Ua (r, d), Ub (n_ff, r): exact gate,
                                          rank-r estimate of up
  lr_gate_up |act(Gb_j · (Ga h)) · (Ub_j · (Ua h))|  rank-r estimates of both gate and up
Everything works in slots: row j of every (n_ff, ·) matrix belongs to bundle slot j of ffn.bin.

On disk (next to the model): predictor.bin (or predictor-new.bin: a new predictor goes under
the name the manifest does not use, so the old one stays valid until the manifest's switch), a
64-byte header then 64-byte-aligned tensors, and
the manifest's `predictor` section: {"kind", "file", "nbytes", "thresholds", "tensors": [{"name",
"dtype", "shape", "offset", "nbytes", "crc32"}], ...metrics}. An empty section means none.
"""
from __future__ import annotations

import json
import math
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Protocol

import numpy as np

from flashllm.ffi import kernel
from flashllm.sparsity.activations import activation
from flashllm.format.layout import DTYPE_CODES, MANIFEST_FILE, align_up, fits, tensor_nbytes
from flashllm.format.files import free_name, switch
from flashllm.format.manifest import read_manifest
from flashllm.format.reader import FlashModel
from flashllm.model.config import ModelConfig
from flashllm.errors import FormatError
from flashllm.model.tensor import QTensor

PREDICTOR_FILE = "predictor.bin"
PREDICTOR_NAMES = (PREDICTOR_FILE, "predictor-new.bin")   # a new one goes under the free name
PRED_MAGIC = b"FLPRED\0\0"
PRED_VERSION = 1
PRED_ALIGN = 64
# magic, version, header_bytes, n_tensors, file_bytes; zero-padded to PRED_ALIGN
PRED_HEADER = struct.Struct("<8sIIQQ")

# kind -> per-layer tensor roles (1-D roles are f32 vectors)
KINDS: dict[str, tuple[str, ...]] = {
    "lowrank": ("a", "b", "bias"),
    "gate": ("gate",),
    "gate_up": ("gate", "up"),
    "gate_lrup": ("gate", "up_a", "up_b"),
    "lr_gate_up": ("gate_a", "gate_b", "up_a", "up_b"),
}


class NeuronPredictor(Protocol):
    """What the sparse FFN (runtime/sparse_ffn.py) asks of a predictor: Predictor, AllSlots."""

    @property
    def nbytes(self) -> int:
        """DRAM it holds."""
        ...

    def predict(self, layer: int, h: np.ndarray) -> np.ndarray:
        """(m,) int32 sorted slots predicted active for at least one token of h (T, d_model)."""
        ...


@dataclass
class Predictor:
    """Per-layer matrices and thresholds of one predictor kind (see the module docstring)."""

    config: ModelConfig
    kind: str
    layers: list[dict]                  # per layer: role -> QTensor (matrices) or (n,) f32 vector
    thresholds: list[float]             # per layer: active when score >= threshold
    n_threads: int = 1
    metrics: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise FormatError(f"unknown predictor kind {self.kind!r}: expected one of "
                              f"{', '.join(KINDS)}")
        n = self.config.n_layers
        if len(self.layers) != n or len(self.thresholds) != n:
            raise FormatError(f"a predictor needs {n} layers and thresholds, got "
                              f"{len(self.layers)} and {len(self.thresholds)}")
        for i, parts in enumerate(self.layers):
            _check_layer(self.config, self.kind, i, parts)
        if not all(math.isfinite(t) for t in self.thresholds):
            raise FormatError("predictor thresholds must be finite numbers")

    @property
    def name(self) -> str:
        dt = "/".join(sorted({p.dtype for p in self.layers[0].values() if isinstance(p, QTensor)}))
        ranks = sorted({p.rows for role, p in self.layers[0].items() if role in ("a", "gate_a", "up_a")})
        return f"{self.kind}" + (f"-r{ranks[0]}" if ranks else "") + f"-{dt}"

    @property
    def nbytes(self) -> int:
        """DRAM the predictor holds (matrices and vectors, all layers)."""
        return sum(int(p.nbytes) for parts in self.layers for p in parts.values())

    def score(self, layer: int, h) -> np.ndarray:
        """(T, n_ff) f32 score of every slot for each token of h (T, d_model)."""
        p, nt = self.layers[layer], self.n_threads
        x = np.ascontiguousarray(h, dtype=np.float32)                    # (T, d_model)
        if self.kind == "lowrank":
            z = kernel.matmul(p["a"], x, n_threads=nt)                   # (T, r)
            return kernel.matmul(p["b"], z, p["bias"], n_threads=nt)     # (T, n_ff)
        with np.errstate(over="ignore"):
            g = activation(self._project(p, "gate", x), self.config.act)  # (T, n_ff)
        if self.kind == "gate":
            return np.abs(g)
        return np.abs(g * self._project(p, "up", x))                     # (T, n_ff)

    def _project(self, parts: dict, role: str, x: np.ndarray) -> np.ndarray:
        """(T, n_ff) W x for the full matrix `role`, or Wb (Wa x) for its low-rank pair."""
        if role in parts:
            return kernel.matmul(parts[role], x, n_threads=self.n_threads)
        z = kernel.matmul(parts[role + "_a"], x, n_threads=self.n_threads)          # (T, r)
        return kernel.matmul(parts[role + "_b"], z, n_threads=self.n_threads)

    def predict(self, layer: int, h) -> np.ndarray:
        """(m,) int32 sorted slots predicted active for at least one token of h (T, d_model)."""
        s = self.score(layer, h)                                         # (T, n_ff)
        hit = (s >= self.thresholds[layer]).any(axis=0)                  # (n_ff,) bool
        return np.flatnonzero(hit).astype(np.int32)


class AllSlots:
    """Every slot active: with threshold 0 the flash path computes exactly the dense FFN."""

    nbytes = 0

    def __init__(self, n_ff: int):
        self.slots = np.arange(n_ff, dtype=np.int32)            # (n_ff,)
        self.n_static = n_ff          # predicts slots 0 .. n_static-1 whatever the input

    def predict(self, layer: int, h: np.ndarray) -> np.ndarray:
        return self.slots


def _check_layer(cfg: ModelConfig, kind: str, i: int, parts: dict) -> None:
    """FormatError unless layer i's parts are exactly the kind's roles with consistent shapes."""
    roles = KINDS[kind]
    if set(parts) != set(roles):
        raise FormatError(f"predictor layer {i}: {kind} needs {list(roles)}, got {sorted(parts)}")
    for role, want in _shapes(cfg, kind, parts).items():
        got = parts[role]
        shape = (got.rows, got.cols) if isinstance(got, QTensor) else np.shape(got)
        if tuple(shape) != want:
            raise FormatError(f"predictor layer {i}: {role} has shape {list(shape)}, expected "
                              f"{list(want)}")
        if not isinstance(got, QTensor) and (len(want) != 1 or got.dtype != np.float32):
            raise FormatError(f"predictor layer {i}: {role} must be a matrix or an f32 vector")


def _shapes(cfg: ModelConfig, kind: str, parts: dict) -> dict[str, tuple[int, ...]]:
    """role -> expected shape; a low rank is read from the A matrix itself."""
    d, n = cfg.d_model, cfg.n_ff
    rank = lambda role: parts[role].rows if isinstance(parts[role], QTensor) else -1  # noqa: E731
    if kind == "lowrank":
        return {"a": (rank("a"), d), "b": (n, rank("a")), "bias": (n,)}
    out = {role: (n, d) for role in KINDS[kind] if role in ("gate", "up")}
    for w in ("gate", "up"):
        if w + "_a" in KINDS[kind]:
            out.update({w + "_a": (rank(w + "_a"), d), w + "_b": (n, rank(w + "_a"))})
    return out


# ---- saving -----------------------------------------------------------------------------------

def save_predictor(path: Path, predictor: Predictor, metrics: dict) -> None:
    """Write the predictor into the model folder at path and point the manifest at it: the file
    under the name the manifest does not use (write_predictor), the manifest switched to it in
    one atomic rename, then the old file removed. Interrupted, the folder keeps its old predictor."""
    path = Path(path)
    old = (read_manifest(path).get("predictor") or {}).get("file")
    section = write_predictor(path, predictor, metrics, old)
    switch(path, [old] if old and old != section["file"] else [], predictor=section)


def write_predictor(path: Path, predictor: Predictor, metrics: dict,
                    current: Optional[str]) -> dict:
    """The predictor written into the model folder at path under the one of PREDICTOR_NAMES that
    is not current (the file the manifest names now; temporary name, fsync, rename), the manifest
    left as it is; its `predictor` section."""
    name = free_name(current, PREDICTOR_NAMES)
    entries, blobs, off = [], [], PRED_ALIGN
    for i, parts in enumerate(predictor.layers):
        for role in KINDS[predictor.kind]:
            data, dtype, shape = _raw(parts[role])                        # (nbytes,) uint8
            off = align_up(off, PRED_ALIGN)
            entries.append({"name": f"blk.{i}.{role}", "dtype": dtype, "shape": list(shape),
                            "offset": off, "nbytes": int(data.size), "crc32": zlib.crc32(data)})
            blobs.append((off, data))
            off += data.size
    header = PRED_HEADER.pack(PRED_MAGIC, PRED_VERSION, PRED_ALIGN, len(entries), off)
    _write_atomic(Path(path) / name, header, blobs, off)
    section = {**metrics, "kind": predictor.kind, "file": name, "nbytes": off,
               "bytes": predictor.nbytes, "thresholds": [float(t) for t in predictor.thresholds],
               "tensors": entries}
    return json.loads(json.dumps(section))


def _raw(part) -> tuple[np.ndarray, str, tuple[int, ...]]:
    if isinstance(part, QTensor):
        return part.data.reshape(-1), part.dtype, (part.rows, part.cols)
    v = np.ascontiguousarray(part, dtype="<f4")                           # (n,)
    return v.view(np.uint8), "f32", v.shape


def _write_atomic(file: Path, header: bytes, blobs: list, size: int) -> None:
    tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(header.ljust(PRED_ALIGN, b"\0"))
            for off, data in blobs:
                f.write(b"\0" * (off - f.tell()))
                f.write(memoryview(data))
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, file)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise FormatError(f"cannot write {file}: {e.strerror or e}") from None


# ---- loading ----------------------------------------------------------------------------------

def load_predictor(flash: FlashModel, n_threads: int = 1) -> Optional[Predictor]:
    """The predictor the manifest names (validated, checksums checked), or None when it has none."""
    sec = flash.manifest.get("predictor") or {}
    if not sec:
        return None
    where = f"{flash.path / MANIFEST_FILE} predictor"
    kind, name, size = sec.get("kind"), sec.get("file"), sec.get("nbytes")
    if kind not in KINDS:
        raise FormatError(f"{where}: unknown kind {kind!r}")
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise FormatError(f"{where}: file {name!r} is not a plain file name")
    data = _read_file(flash.path / name, size, where)                     # (size,) uint8
    tables = _tensor_table(sec.get("tensors"), data, where)
    cfg = flash.config
    layers = [{} for _ in range(cfg.n_layers)]
    for tname, t in tables.items():
        blk, _, role = tname.partition(".")[2].partition(".")
        if not blk.isdigit() or int(blk) >= cfg.n_layers or role not in KINDS[kind]:
            raise FormatError(f"{where}: unexpected tensor {tname} for a {kind} predictor")
        layers[int(blk)][role] = t
    th = sec.get("thresholds")
    if not isinstance(th, list) or not all(_is_num(v) for v in th):
        raise FormatError(f"{where}: thresholds must be a list of numbers")
    try:
        return Predictor(cfg, kind, layers, [float(v) for v in th], n_threads,
                         {k: v for k, v in sec.items() if k != "tensors"})
    except FormatError as e:
        raise FormatError(f"{where}: {e}") from None


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _read_file(file: Path, size, where: str) -> np.ndarray:
    if not isinstance(size, int) or isinstance(size, bool) or size < PRED_HEADER.size:
        raise FormatError(f"{where}: nbytes {size!r} is not a valid size")
    try:
        data = np.fromfile(file, dtype=np.uint8)                          # (file_bytes,)
    except OSError:
        raise FormatError(f"{file}: missing or unreadable") from None
    if data.size != size:
        raise FormatError(f"{file}: {data.size} bytes, the manifest says {size}")
    magic, version, hbytes, _, fbytes = PRED_HEADER.unpack_from(data)
    if magic != PRED_MAGIC or version != PRED_VERSION or hbytes != PRED_ALIGN or fbytes != size:
        raise FormatError(f"{file}: bad header (not a flashllm predictor of version "
                          f"{PRED_VERSION})")
    return data


def _tensor_table(tensors, data: np.ndarray, where: str) -> dict:
    """name -> QTensor / (n,) f32 view into data, every entry checked (bounds, size, crc32)."""
    if not isinstance(tensors, list):
        raise FormatError(f"{where}: tensors must be a list")
    out, spans = {}, []
    for i, t in enumerate(tensors):
        w = f"{where}.tensors[{i}]"
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or t["name"] in out:
            raise FormatError(f"{w}: missing or duplicated name")
        shape, dt = t.get("shape"), t.get("dtype")
        if not isinstance(shape, list) or len(shape) not in (1, 2) or \
                not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape):
            raise FormatError(f"{w}: bad shape {shape!r}")
        if dt not in DTYPE_CODES or not fits(dt, shape[-1]) or (len(shape) == 1 and dt != "f32"):
            raise FormatError(f"{w}: {t['name']} cannot be stored as {dt!r} with shape {shape}")
        off, nb = t.get("offset"), t.get("nbytes")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (off, nb, t.get("crc32"))) \
                or nb != tensor_nbytes(dt, tuple(shape)) or off < PRED_ALIGN or off + nb > data.size:
            raise FormatError(f"{w}: {t['name']} has a bad offset/size/crc32 entry")
        raw = data[off:off + nb]                                          # (nbytes,) uint8
        if zlib.crc32(raw) != t["crc32"]:
            raise FormatError(f"{w}: checksum mismatch in {t['name']}")
        spans.append((off, off + nb))
        out[t["name"]] = raw.view("<f4") if len(shape) == 1 else \
            QTensor(raw.reshape(shape[0], -1), dt, *shape)
    spans.sort()
    if any(b0 < a1 for (_, a1), (b0, _) in zip(spans, spans[1:])):
        raise FormatError(f"{where}: tensors overlap")
    return out
