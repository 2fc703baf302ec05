"""QTensor: a 2-D weight kept in its storage dtype, and the dtype names <-> C codes."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashllm.errors import KernelError

# values are part of the on-disk format (native/flashllm.h, FL_F32 ..)
DTYPE_CODES = {"f32": 0, "f16": 1, "q8_0": 2, "q4_0": 3, "q4_1": 4, "q4_k": 5, "q5_0": 6,
               "q5_1": 7, "q5_k": 8, "q6_k": 9, "q2_k": 10, "q3_k": 11}
DTYPES = tuple(DTYPE_CODES)      # every storage dtype, in code order
BLOCK_SIZE = {"f32": 1, "f16": 1, "q8_0": 32, "q4_0": 32, "q4_1": 32, "q4_k": 256, "q5_0": 32,
              "q5_1": 32, "q5_k": 256, "q6_k": 256, "q2_k": 256,
              "q3_k": 256}
BLOCK_BYTES = {"f32": 4, "f16": 2, "q8_0": 34, "q4_0": 18, "q4_1": 20, "q4_k": 144, "q5_0": 22,
               "q5_1": 24, "q5_k": 176, "q6_k": 210, "q2_k": 84,
               "q3_k": 110}
# the ggml type of each storage dtype (GGUF tensors in these types are copied byte for byte;
# q2_k is also the output head's sketch, runtime/sparse_head.py)
GGML_TYPE = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1",
             "q4_k": "Q4_K", "q5_0": "Q5_0", "q5_1": "Q5_1", "q5_k": "Q5_K", "q6_k": "Q6_K",
             "q2_k": "Q2_K", "q3_k": "Q3_K"}
FROM_GGML = {v: k for k, v in GGML_TYPE.items()}
# what a conversion's --dtype can quantize floats to (its k-quant rows are copied from a GGUF)
QUANTIZABLE = ("f32", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
# the k-quants flashllm makes from floats (native/kquant.c, ggml's reference quantizers): a
# native conversion's down columns
KQUANTS = ("q4_k", "q5_k", "q6_k")
# the dtypes a bundle's down column may have (applied in f32 by the kernel)
DOWN_DTYPES = QUANTIZABLE + KQUANTS
# a q4_k model keeps only gate / up rows in q4_k (ggml Q4_K blocks copied from the source): its
# FFN down columns and its dense tensors are stored as q4_1
COMPANION = {"q4_k": "q4_1"}


def companion(dtype: str) -> str:
    """The dtype of a model's FFN down columns and dense tensors (= dtype but for q4_k)."""
    return COMPANION.get(dtype, dtype)


def dtype_code(dtype: str) -> int:
    """The C code of a storage dtype name; KernelError when the name is unknown."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise KernelError(
            f"unknown storage dtype {dtype!r}: expected one of {', '.join(DTYPE_CODES)}"
        ) from None


def row_bytes(dtype: str, n: int) -> int:
    """Bytes of one row of n values in dtype (quantized dtypes need n % 32 == 0, q4_k % 256)."""
    dtype_code(dtype)
    block = BLOCK_SIZE[dtype]
    if n <= 0 or n % block:
        raise KernelError(f"a {dtype} row needs a positive multiple of {block} values, got {n}")
    return n // block * BLOCK_BYTES[dtype]


@dataclass(frozen=True)
class QTensor:
    """A 2-D weight (rows, cols) kept in its storage dtype, one ggml-compatible row per data row."""

    data: np.ndarray  # (rows, row_bytes) uint8, C-contiguous
    dtype: str
    rows: int
    cols: int

    def __post_init__(self) -> None:
        expected = (self.rows, row_bytes(self.dtype, self.cols))
        if self.data.dtype != np.uint8 or self.data.shape != expected:
            raise KernelError(
                f"QTensor data must be uint8 of shape {expected} for {self.rows}x{self.cols} "
                f"{self.dtype}, got {self.data.dtype} {self.data.shape}"
            )
        if not self.data.flags.c_contiguous:
            raise KernelError("QTensor data must be C-contiguous")

    @property
    def code(self) -> int:
        """The C dtype code."""
        return DTYPE_CODES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of the stored data."""
        return int(self.data.nbytes)


@dataclass(frozen=True)
class PackedTensor:
    """A resident weight (rows, cols) repacked for this build's matmul (ffi/kernel.pack): its
    values are those of the QTensor it was made from, in another order."""

    data: np.ndarray  # (nbytes,) uint8
    dtype: str
    rows: int
    cols: int

    @property
    def code(self) -> int:
        return DTYPE_CODES[self.dtype]
