"""quant.py / fl_quantize_row against gguf-py's reference quantizers (bit-exact with ggml)."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GQ
from gguf.quants import dequantize, quantize

from flashllm.errors import KernelError
from flashllm.ffi.quant import dequantize_rows, quantize_rows
from flashllm.model.tensor import row_bytes
from flashllm.model.tensor import QTensor

GGUF_TYPES = {"f32": GQ.F32, "f16": GQ.F16, "q8_0": GQ.Q8_0, "q4_0": GQ.Q4_0}


def _matrix(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scale = rng.uniform(1e-3, 20.0, (rows, 1))  # (rows, 1): per-row magnitudes
    x = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)  # (rows, cols)
    x[0] = 0.0  # an all-zero block (d = 0)
    x[1, :32] = 1.0  # a constant block
    x[2, 7] = -50.0  # the largest magnitude is negative
    return x


def _gguf_bytes(x: np.ndarray, dtype: str) -> np.ndarray:
    return quantize(x, GGUF_TYPES[dtype]).view(np.uint8).reshape(x.shape[0], -1)


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("threads", [1, 2])
def test_quantize_bytes_match_gguf(dtype, threads):
    x = _matrix(67, 320, seed=1)  # (67, 320)
    ours = quantize_rows(x, dtype, n_threads=threads)  # (67, row_bytes)
    assert ours.shape == (67, row_bytes(dtype, 320))
    np.testing.assert_array_equal(ours, _gguf_bytes(x, dtype))


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
def test_rounding_ties_match_gguf(dtype):
    # x / d lands exactly on .5 for many values: ggml rounds q8_0 half away from zero and q4_0
    # by truncating x / d + 8.5
    x = (np.arange(-128, 128, dtype=np.float32) + 0.5).reshape(8, 32)  # (8, 32)
    x[:, 0] = np.where(np.arange(8) % 2, 127.0, -8.0)  # scales with exact ties
    np.testing.assert_array_equal(quantize_rows(x, dtype), _gguf_bytes(x, dtype))


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0", "q4_0"])
def test_dequantize_matches_gguf(dtype):
    x = _matrix(40, 256, seed=2)  # (40, 256)
    data = _gguf_bytes(x, dtype)  # (40, row_bytes)
    ref = dequantize(data, GGUF_TYPES[dtype]).reshape(40, 256)  # (40, 256)
    np.testing.assert_array_equal(dequantize_rows(data, dtype, 256, n_threads=2), ref)


def test_dequantize_of_special_f16_values():
    h = np.array([0, 1, 0x3FF, 0x400, 0x7BFF, 0x7C00, 0xFC00, 0x8001, 0x3C00], np.uint16)
    data = h.view(np.uint8).reshape(1, -1)  # (1, 18)
    np.testing.assert_array_equal(dequantize_rows(data, "f16", h.size)[0],
                                  h.view(np.float16).astype(np.float32))


def test_row_bytes_values():
    assert [row_bytes(t, 64) for t in ("f32", "f16", "q8_0", "q4_0")] == [256, 128, 68, 36]


@pytest.mark.parametrize("call", [
    lambda: row_bytes("q4_0", 33),
    lambda: row_bytes("iq2_xs", 256),
    lambda: quantize_rows(np.zeros((2, 48), np.float32), "q8_0"),
    lambda: quantize_rows(np.zeros(64, np.float32), "q8_0"),
    lambda: dequantize_rows(np.zeros((2, 35), np.uint8), "q8_0", 32),
    lambda: QTensor(np.zeros((2, 34), np.uint8), "q4_0", 2, 32),
    lambda: QTensor(np.zeros((4, 34), np.uint8)[::2], "q8_0", 2, 32),
])
def test_bad_arguments_raise_kernel_error(call):
    with pytest.raises(KernelError):
        call()
