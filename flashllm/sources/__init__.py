"""Checkpoint readers: a Hugging Face safetensors folder or a GGUF file, behind one interface.

`open_source(path)` decides by content, never by name alone: the GGUF magic, or a folder holding
config.json and *.safetensors. Pickle checkpoints (.bin/.pt/.pth/.ckpt) are refused, never
unpickled. Every source hands out canonical tensor names (docs/ARCHITECTURE.md) and float32
arrays in Hugging Face semantics, one tensor at a time.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..errors import SourceError

GGUF_MAGIC = b"GGUF"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_PICKLE_HINT = ("pickle checkpoints are never unpickled (they can run code); convert it to safetensors "
                "first, e.g. `model.save_pretrained(dir, safe_serialization=True)` with transformers")


class Source(ABC):
    """One open checkpoint. Lazy: `load` reads one tensor; nothing else is held in memory."""

    path: Path
    config: ModelConfig
    tokenizer_json: str | None     # Hugging Face tokenizers JSON, or None when the checkpoint has none
    chat_template: str | None      # Jinja chat template, or None

    @abstractmethod
    def tensor_names(self) -> list[str]:
        """Canonical names of every tensor, in checkpoint order."""

    @abstractmethod
    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape of a canonical tensor in HF semantics (a linear weight is (out, in))."""

    @abstractmethod
    def load(self, name: str) -> np.ndarray:
        """The tensor as a new float32 array in HF semantics."""

    def stored_type(self, name: str) -> str:
        """The source's own storage type of a tensor (a ggml type name such as "Q4_K" for GGUF,
        else e.g. "F32"); only `load_blocks` of a block-quantized type gives its bytes."""
        return "F32"

    def load_blocks(self, name: str) -> np.ndarray:
        """A 2-D tensor's stored bytes, unconverted: (rows, bytes per row) uint8."""
        raise SourceError(f"{self.path}: tensor {name!r} has no stored blocks to copy")

    @abstractmethod
    def close(self) -> None:
        """Release file handles and maps; the source is unusable afterwards."""

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _unknown(self, name: str) -> SourceError:
        return SourceError(f"{self.path}: no tensor named {name!r}")


def _refuse_pickle(path: Path) -> SourceError:
    return SourceError(f"{path}: {_PICKLE_HINT}")


def _open_file(path: Path) -> Source:
    with open(path, "rb") as f:
        head = f.read(4)
    if head == GGUF_MAGIC:
        from .gguf_file import GGUFSource
        return GGUFSource(path)
    if path.suffix in PICKLE_SUFFIXES or head[:1] == b"\x80" or head == b"PK\x03\x04":
        raise _refuse_pickle(path)
    if path.suffix == ".safetensors":
        raise SourceError(f"{path}: a lone safetensors file has no config; pass the folder that holds "
                          "it together with config.json")
    if path.suffix == ".gguf":
        raise SourceError(f"{path}: not a GGUF file (magic {head!r}, expected {GGUF_MAGIC!r})")
    raise SourceError(f"{path}: neither a GGUF file nor a Hugging Face folder")


def _open_folder(path: Path) -> Source:
    has_safetensors = any(path.glob("*.safetensors"))
    if (path / "config.json").is_file() and has_safetensors:
        from .hf import HFSource
        return HFSource(path)
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles and not has_safetensors:
        raise SourceError(f"{path}: holds only {', '.join(pickles[:3])}; {_PICKLE_HINT}")
    ggufs = sorted(path.glob("*.gguf"))
    if ggufs:
        raise SourceError(f"{path}: pass the GGUF file itself, e.g. {ggufs[0]}")
    if not has_safetensors:
        raise SourceError(f"{path}: no *.safetensors weights in this folder")
    raise SourceError(f"{path}: no config.json next to the safetensors weights")


def open_source(path: Path) -> Source:
    """Open a checkpoint by its content: GGUF file or HF safetensors folder."""
    path = Path(path)
    if not path.exists():
        raise SourceError(f"{path}: no such file or folder")
    return _open_folder(path) if path.is_dir() else _open_file(path)


__all__ = ["Source", "open_source", "GGUF_MAGIC"]
