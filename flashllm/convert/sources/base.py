"""The interface every checkpoint reader implements (one tensor at a time, canonical names, HF
semantics), and the GGUF magic that `open_source` and the GGUF reader share."""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from flashllm.errors import SourceError
from flashllm.model.config import ModelConfig

GGUF_MAGIC = b"GGUF"


class Source(ABC):
    """One open checkpoint. Lazy: `load` reads one tensor; nothing else is held in memory."""

    path: Path
    config: ModelConfig
    tokenizer_json: object         # Hugging Face tokenizers JSON (a str, or an object whose
    #                                write(put) streams its bytes: gguf_vocab.GGUFVocab), or None
    chat_template: str | None      # Jinja chat template, or None
    stores_blocks = False          # True: 2-D tensors have stored blocks (load_blocks), as in a GGUF

    @abstractmethod
    def tensor_names(self) -> list[str]:
        """Canonical names of every tensor, in checkpoint order."""

    @abstractmethod
    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape of a canonical tensor in HF semantics (a linear weight is (out, in))."""

    def tensor_nbytes(self, name: str) -> int:
        """Bytes the checkpoint stores the tensor in (what converting it reads)."""
        return 4 * int(np.prod(self.tensor_shape(name)))

    @abstractmethod
    def load(self, name: str) -> np.ndarray:
        """The tensor as a new float32 array in HF semantics."""

    def load_rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows r0 .. r1 of a 2-D tensor as a new float32 (r1 - r0, cols) array."""
        return np.ascontiguousarray(self.load(name)[r0:r1])

    def load_cols(self, name: str, c0: int, c1: int) -> np.ndarray:
        """Columns c0 .. c1 of a 2-D tensor as a new float32 (rows, c1 - c0) array; c0 and c1
        whole blocks of its stored type (col_block), or c1 its last column."""
        return np.ascontiguousarray(self.load(name)[:, c0:c1])

    def col_block(self, name: str) -> int:
        """The column granularity load_cols reads a tensor in (its stored type's block)."""
        return 1

    def load_expert(self, name: str, expert: int) -> np.ndarray:
        """Expert `expert` of a 3-D MoE tensor (n_experts, rows, cols) as a new float32 (rows, cols)
        array: one expert in memory, not the layer's all."""
        return np.ascontiguousarray(self.load(name)[expert])

    def stored_type(self, name: str) -> str:
        """The source's own storage type of a tensor (a ggml type name such as "Q4_K" for GGUF,
        else e.g. "F32"); only `load_blocks` of a block-quantized type gives its bytes."""
        return "F32"

    def load_blocks(self, name: str) -> np.ndarray:
        """A 2-D tensor's stored bytes, unconverted: (rows, bytes per row) uint8."""
        raise SourceError(f"{self.path}: tensor {name!r} has no stored blocks to copy")

    def load_expert_blocks(self, name: str, expert: int) -> np.ndarray:
        """Expert `expert` of a 3-D MoE tensor as stored, unconverted: (rows, bytes per row) uint8."""
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
