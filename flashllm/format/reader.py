"""Reading a flash model folder (docs/FORMAT.md): open_flash validates everything before use.

Nothing is loaded at open: `tensor(name)` reads one dense tensor from dense.bin into DRAM when it is
asked for (the caller keeps it resident or not; `dense_entry` gives the offsets for streaming it),
FFN layers are read from ffn.bin on demand (the runtime's direct-I/O reader uses FlashModel.ffn
for offsets and strides), and `tokenizer_bytes` reads tokenizer.json each time it is asked for (a
one-shot run drops the text once the prompt is encoded; the model must not keep a copy).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from flashllm.format.layout import (NATIVE, DENSE_FILE, DENSE_HEADER, DENSE_MAGIC, DTYPE_CODES,
                                    FFN_FILE, MANIFEST_FILE, MAX_TOKENIZER_BYTES, MERGES_FORMS,
                                    crc32_file, fits, ffn_weight, required_tensors, tensor_nbytes)
from flashllm.format.checks import check_down_rows, file_size as _file_size, get as _get, nat as _nat, \
    side_file as _side_file
from flashllm.model.archs import arch_named
from flashllm.model.config import ModelConfig
from flashllm.errors import FormatError
from flashllm.format.ffn_section import FfnLayout, check_ffn
from flashllm.format.manifest import Manifest, read_manifest
from flashllm.model.tensor import QTensor

__all__ = ["FlashModel", "FfnLayout", "open_flash"]


def open_flash(path: Path, verify: bool = False, manifest: Manifest | None = None) -> "FlashModel":
    """Open and validate a converted model folder; verify=True also checks every checksum.
    manifest: the folder's, when the caller has read it (format/manifest.read_manifest)."""
    model = FlashModel(Path(path), manifest)
    if verify:
        model.verify()
    return model


class FlashModel:
    """A validated flash model: manifest, config, the dense tensor table, the FFN layout."""

    def __init__(self, path: Path, manifest: Manifest | None = None) -> None:
        if not path.is_dir():
            raise FormatError(f"{path}: no such model folder")
        self.path = path
        self.manifest: Manifest = manifest if manifest is not None else read_manifest(path)
        self.config: ModelConfig = _config(self.manifest)
        self.dtype: str = _get(self.manifest, "dtype", str, MANIFEST_FILE)
        if self.dtype not in DTYPE_CODES and self.dtype != NATIVE:
            raise FormatError(f"{path / MANIFEST_FILE}: unknown storage dtype {self.dtype!r}")
        self._tensors = _check_tensors(path, self.manifest, self.config)
        self.dense_file = path / DENSE_FILE
        _check_dense_header(self.dense_file, self.manifest, self._tensors)
        self.ffn: FfnLayout = check_ffn(path, self.manifest, self.config)
        # per layer the down matrix's entry in down.bin (format/writer.py), or None (older folders)
        self.down_rows: list[dict] | None = check_down_rows(path, self.manifest, self.config)
        self._tokenizer, self.chat_template = _tokenizer_entry(path, self.manifest)

    @property
    def tokenizer_bytes(self) -> bytes | None:
        """The Hugging Face tokenizer JSON as UTF-8 bytes, read now from tokenizer.json; None when
        the model has no tokenizer. Not kept: the caller holds it as long as it needs it. Bytes,
        not a str: a vocabulary with characters beyond U+FFFF takes four bytes a character as a
        Python str (Gemma's 12 MiB file: 49.5 MiB)."""
        return None if self._tokenizer is None else _read_bytes(*self._tokenizer)

    @property
    def tokenizer_json(self) -> str | None:
        """tokenizer_bytes as text."""
        data = self.tokenizer_bytes
        try:
            return None if data is None else data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise FormatError(f"{self._tokenizer[0]}: unreadable ({e})") from None

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def dense_entry(self, name: str) -> dict:
        """The manifest entry of a dense tensor: offset, nbytes, dtype, shape (in dense.bin)."""
        t = self._tensors.get(name)
        if t is None:
            raise FormatError(f"{self.path}: no tensor {name} in {DENSE_FILE}")
        return t

    def tensor(self, name: str) -> QTensor | np.ndarray:
        """A 2-D weight as a QTensor, a 1-D tensor as an (n,) f32 array, read now from dense.bin."""
        t = self.dense_entry(name)
        raw = _read_span(self.dense_file, t["offset"], t["nbytes"])              # (nbytes,) uint8
        return as_tensor(raw, t)

    def read_ffn_layer(self, layer: int) -> np.ndarray:
        """Layer `layer`'s bundles read into DRAM: (n_ff, its stride) uint8."""
        if not 0 <= layer < self.config.n_layers:
            raise FormatError(f"FFN layer {layer} out of range (model has {self.config.n_layers})")
        f = self.ffn
        buf = np.empty((f.n_ff, f.strides[layer]), dtype=np.uint8)               # (n_ff, stride)
        with open(f.file, "rb") as fh:
            fh.seek(f.layer_offsets[layer])
            got = fh.readinto(memoryview(buf).cast("B"))
        if got != buf.nbytes:
            raise FormatError(f"{f.file}: layer {layer} truncated ({got} of {buf.nbytes} bytes)")
        return buf

    def read_down_rows(self, layer: int) -> QTensor:
        """Layer `layer`'s down matrix (d_model, n_ff) as the source stores it, read from down.bin."""
        if self.down_rows is None:
            raise FormatError(f"{self.path}: no down rows (converted before they were kept)")
        t = self.down_rows[layer]
        raw = _read_span(self.path / self.manifest["down_rows"]["file"], t["offset"], t["nbytes"])
        return as_tensor(raw, t)                                         # (d_model, n_ff)

    def verify(self) -> None:
        """Check the crc32 of every dense tensor, FFN layer and side file; FormatError on mismatch."""
        with open(self.dense_file, "rb") as fh:
            for name, t in self._tensors.items():
                if crc32_file(fh, t["offset"], t["nbytes"]) != t["crc32"]:
                    raise FormatError(f"{self.dense_file}: checksum mismatch in tensor {name}")
        with open(self.ffn.file, "rb") as fh:
            for layer, (off, want) in enumerate(zip(self.ffn.layer_offsets, self.ffn.layer_crc32)):
                if crc32_file(fh, off, self.ffn.layer_nbytes(layer)) != want:
                    raise FormatError(f"{self.ffn.file}: checksum mismatch in FFN layer {layer}")
        if self.down_rows is not None:
            with open(self.path / self.manifest["down_rows"]["file"], "rb") as fh:
                for layer, t in enumerate(self.down_rows):
                    if crc32_file(fh, t["offset"], t["nbytes"]) != t["crc32"]:
                        raise FormatError(f"{fh.name}: checksum mismatch in layer {layer}")
        for entry in (self.manifest["tokenizer"], self.manifest["ffn"].get("neuron_order")):
            if entry and entry.get("file"):
                with open(self.path / entry["file"], "rb") as fh:
                    if crc32_file(fh, 0, entry["nbytes"]) != entry["crc32"]:
                        raise FormatError(f"{self.path / entry['file']}: checksum mismatch")


# ---- validation helpers (more in format/checks.py) ------------------------------------------

_FLOAT_FIELDS = ("norm_eps", "rope_theta", "embed_scale")
_BOOL_FIELDS = ("glu", "tied_embeddings", "attn_qkv_bias", "attn_out_bias", "ffn_bias", "qk_norm",
                "qk_norm_full", "norm_topk", "sandwich_norm")
_INT_FIELDS = ("pos_offset", "d_embed")


def _config(m: dict) -> ModelConfig:
    try:
        cfg = ModelConfig.from_dict(m["config"])
        arch_named(cfg.arch)
        _check_config_types(cfg)
        return cfg
    except FormatError as e:
        raise FormatError(f"{MANIFEST_FILE}: {e}") from None


def _check_config_types(cfg: ModelConfig) -> None:
    """The fields ModelConfig.validate leaves alone: numbers, flags and token ids."""
    for name in _FLOAT_FIELDS:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise FormatError(f"config field {name}={v!r} must be a positive finite number")
    for name in _BOOL_FIELDS:
        if not isinstance(getattr(cfg, name), bool):
            raise FormatError(f"config field {name}={getattr(cfg, name)!r} must be true or false")
    for name in _INT_FIELDS:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise FormatError(f"config field {name}={v!r} must be a non-negative integer")
    ids = cfg.eos_token_ids + (() if cfg.bos_token_id is None else (cfg.bos_token_id,))
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < cfg.vocab_size:
            raise FormatError(f"config token id {i!r} (bos/eos) is not in [0, {cfg.vocab_size})")


def _check_tensors(path: Path, m: dict, cfg: ModelConfig) -> dict[str, dict]:
    """The dense tensor table, checked against the format's size rules and the architecture."""
    where = f"{path / MANIFEST_FILE} dense"
    dense = m["dense"]
    if dense.get("compression") is not None:
        raise FormatError(f"{where}: compression {dense['compression']!r} is not supported")
    size = _nat(dense, "nbytes", where)
    tensors: dict[str, dict] = {}
    for i, t in enumerate(_get(dense, "tensors", list, where)):
        w = f"{where}.tensors[{i}]"
        name = _get(t, "name", str, w)
        shape = tuple(_get(t, "shape", list, w))
        if len(shape) not in (1, 2) or not all(isinstance(s, int) and s > 0 for s in shape):
            raise FormatError(f"{w}: tensor {name} has a bad shape {list(shape)}")
        dt = _get(t, "dtype", str, w)
        if not fits(dt, shape[-1]) or (len(shape) == 1 and dt != "f32"):
            raise FormatError(f"{w}: tensor {name} cannot be stored as {dt!r} with shape {list(shape)}")
        off, nb = _nat(t, "offset", w), _nat(t, "nbytes", w)
        _nat(t, "crc32", w)
        if nb != tensor_nbytes(dt, shape):
            raise FormatError(f"{w}: tensor {name} has {nb} bytes, its shape and dtype need "
                              f"{tensor_nbytes(dt, shape)}")
        if off < DENSE_HEADER.size or off + nb > size:
            raise FormatError(f"{w}: tensor {name} at [{off}, {off + nb}) lies outside {DENSE_FILE} "
                              f"({size} bytes)")
        if name in tensors or ffn_weight(name):
            raise FormatError(f"{w}: tensor {name} is duplicated or belongs in {FFN_FILE}")
        tensors[name] = {**t, "shape": list(shape)}
    _check_overlaps(tensors, where)
    if cfg.n_layers > len(tensors):     # before listing what every layer needs
        raise FormatError(f"{where}: the config has {cfg.n_layers} layers, {DENSE_FILE} only "
                          f"{len(tensors)} tensors")
    _check_required(tensors, cfg, where)
    return tensors


def _check_overlaps(tensors: dict[str, dict], where: str) -> None:
    spans = sorted((t["offset"], t["offset"] + t["nbytes"], n) for n, t in tensors.items())
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise FormatError(f"{where}: tensors {a} and {b} overlap")


def _check_required(tensors: dict[str, dict], cfg: ModelConfig, where: str) -> None:
    for name, shape in required_tensors(cfg).items():
        if name not in tensors:
            raise FormatError(f"{where}: required tensor {name} is missing")
        if tuple(tensors[name]["shape"]) != shape:
            raise FormatError(f"{where}: tensor {name} has shape {tensors[name]['shape']}, the config "
                              f"needs {list(shape)}")


def as_tensor(raw: np.ndarray, t: dict) -> QTensor | np.ndarray:
    """A dense tensor over its bytes raw (nbytes,) uint8: QTensor (2-D) or (n,) f32 (1-D)."""
    shape = tuple(t["shape"])
    if len(shape) == 1:
        return raw.view(np.float32)                                              # (n,) f32
    return QTensor(raw.reshape(shape[0], -1), t["dtype"], *shape)                # (rows, row_bytes)


def _read_span(file: Path, offset: int, nbytes: int) -> np.ndarray:
    """nbytes of file at offset, into a fresh (nbytes,) uint8 array."""
    data = np.fromfile(file, dtype=np.uint8, count=nbytes, offset=offset)       # (nbytes,)
    if data.size != nbytes:
        raise FormatError(f"{file}: truncated ({data.size} of {nbytes} bytes at {offset})")
    return data


def _check_dense_header(file: Path, m: dict, tensors: dict[str, dict]) -> None:
    _file_size(file, m["dense"]["nbytes"])
    with open(file, "rb") as fh:
        raw = fh.read(DENSE_HEADER.size)
    if len(raw) < DENSE_HEADER.size:
        raise FormatError(f"{file}: truncated header")
    magic, version, header_bytes, n_tensors, file_bytes = DENSE_HEADER.unpack(raw)
    if magic != DENSE_MAGIC:
        raise FormatError(f"{file}: bad magic {magic!r} (not a flashllm dense section)")
    if version != m["format_version"]:
        raise FormatError(f"{file}: format version {version}, the manifest's is {m['format_version']}")
    size = m["dense"]["nbytes"]
    if (n_tensors, file_bytes) != (len(tensors), size) or header_bytes < DENSE_HEADER.size:
        raise FormatError(f"{file}: header ({n_tensors} tensors, {file_bytes} bytes) does not match "
                          f"the manifest ({len(tensors)} tensors, {size} bytes)")


def _tokenizer_entry(path: Path, m: dict) -> tuple[tuple[Path, int] | None, str | None]:
    """((tokenizer.json, its size) or None when the model has none, the chat template)."""
    t, where = m["tokenizer"], f"{path / MANIFEST_FILE} tokenizer"
    template = t.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise FormatError(f"{where}: chat_template is not a string")
    if t.get("merges") is not None and t["merges"] not in MERGES_FORMS:
        raise FormatError(f"{where}: merges {t['merges']!r} is not one of "
                          f"{', '.join(MERGES_FORMS)}")
    if t.get("file") is None:
        return None, template
    file, nbytes = _side_file(path, t, where), _nat(t, "nbytes", where)
    if nbytes > MAX_TOKENIZER_BYTES:
        raise FormatError(f"{where}: {file.name} of {nbytes} bytes, more than any vocabulary's "
                          f"({MAX_TOKENIZER_BYTES >> 20} MiB)")
    _file_size(file, nbytes)
    return (file, nbytes), template


def _read_bytes(file: Path, nbytes: int) -> bytes:
    """A side file's bytes, which must still be nbytes long."""
    try:
        data = file.read_bytes()
    except OSError as e:
        raise FormatError(f"{file}: unreadable ({e})") from None
    if len(data) != nbytes:
        raise FormatError(f"{file}: {len(data)} bytes, the manifest says {nbytes} (changed "
                          f"since the model was opened)")
    return data
