"""Quantize / dequantize whole (rows, cols) matrices to ggml-compatible f32/f16/q8_0/q4_0/q4_1
rows (q4_1 with a search of its step, see fl_quantize_row in native/flashllm.h).

The work runs in the C kernel (through ffi/kernel.py). Rows of one matrix are contiguous blocks, so
a chunk of rows is converted in one C call as one long row, and chunks run on a thread pool (the
GIL is released inside the C calls).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from flashllm.ffi import kernel
from flashllm.errors import KernelError
from flashllm.model.tensor import row_bytes

__all__ = ["quantize_rows", "dequantize_rows"]

_CHUNK_VALUES = 1 << 20  # values per C call


def _chunks(rows: int, cols: int) -> list[tuple[int, int]]:
    """[start, stop) row ranges of about _CHUNK_VALUES values each."""
    step = max(1, _CHUNK_VALUES // max(cols, 1))
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def _run(jobs, n_threads: int) -> None:
    if n_threads < 1:
        raise KernelError(f"n_threads must be at least 1, got {n_threads}")
    if n_threads == 1 or len(jobs) == 1:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(max_workers=n_threads) as pool:
        for future in [pool.submit(job) for job in jobs]:
            future.result()


def quantize_rows(x, dtype: str, n_threads: int = 2) -> np.ndarray:
    """x (rows, cols) float -> (rows, row_bytes(dtype, cols)) uint8, ggml reference rounding."""
    src = np.ascontiguousarray(x, dtype=np.float32)  # (rows, cols)
    if src.ndim != 2:
        raise KernelError(f"quantize_rows needs a 2-D array, got shape {src.shape}")
    rows, cols = src.shape
    out = np.empty((rows, row_bytes(dtype, cols)), np.uint8)  # (rows, row_bytes)

    def job(r0: int, r1: int):
        return lambda: kernel.quantize_row(src[r0:r1].reshape(-1), dtype,
                                           out=out[r0:r1].reshape(-1))

    _run([job(r0, r1) for r0, r1 in _chunks(rows, cols)], n_threads)
    return out


def dequantize_rows(data, dtype: str, cols: int, n_threads: int = 2) -> np.ndarray:
    """data (rows, row_bytes(dtype, cols)) uint8 -> (rows, cols) float32."""
    src = np.ascontiguousarray(data, dtype=np.uint8)  # (rows, row_bytes)
    nb = row_bytes(dtype, cols)
    if src.ndim != 2 or src.shape[1] != nb:
        raise KernelError(f"{dtype} rows of {cols} values must be (rows, {nb}) uint8, "
                          f"got shape {src.shape}")
    rows = src.shape[0]
    out = np.empty((rows, cols), np.float32)  # (rows, cols)

    def job(r0: int, r1: int):
        return lambda: kernel.dequantize_row(src[r0:r1].reshape(-1), dtype, (r1 - r0) * cols,
                                             out=out[r0:r1].reshape(-1))

    _run([job(r0, r1) for r0, r1 in _chunks(rows, cols)], n_threads)
    return out
