"""Checkpoint readers: a Hugging Face safetensors folder or a GGUF file, behind one interface.

`open_source(path)` decides by content, never by name alone: the GGUF magic, or a folder holding
config.json and *.safetensors. Pickle checkpoints (.bin/.pt/.pth/.ckpt) are refused, never
unpickled. Every source hands out canonical tensor names (docs/ARCHITECTURE.md) and float32
arrays in Hugging Face semantics, one tensor at a time.
"""
from __future__ import annotations

from pathlib import Path

from flashllm.convert.paths import check_path
from flashllm.convert.sources.base import GGUF_MAGIC, Source
from flashllm.convert.sources.gguf import GGUFSource
from flashllm.convert.sources.hf import HFSource
from flashllm.errors import SourceError
from flashllm.format.layout import MANIFEST_FILE

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_PICKLE_HINT = ("pickle checkpoints are never unpickled (they can run code); convert it to safetensors "
                "first, e.g. `model.save_pretrained(dir, safe_serialization=True)` with transformers")


def _refuse_pickle(path: Path) -> SourceError:
    return SourceError(f"{path}: {_PICKLE_HINT}")


def _open_file(path: Path) -> Source:
    with open(path, "rb") as f:
        head = f.read(4)
    if head == GGUF_MAGIC:
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
    if (path / MANIFEST_FILE).is_file():
        raise SourceError(f"{path}: already a converted flashllm model (run it with `flashllm run "
                          f"{path}`); convert the GGUF file or Hugging Face folder it came from")
    has_safetensors = any(path.glob("*.safetensors"))
    if (path / "config.json").is_file() and has_safetensors:
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
    check_path(path)
    return _open_folder(path) if path.is_dir() else _open_file(path)


__all__ = ["Source", "check_path", "open_source"]
