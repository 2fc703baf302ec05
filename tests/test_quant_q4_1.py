"""q4_1 rows (fl_quantize_row's step search) against gguf-py's reference Q4_1 and against grids.

The layout is ggml's GGML_TYPE_Q4_1, so gguf-py's dequantizer must read our bytes bit for bit.
The quantizer is not ggml's (that one always takes d = (max - min) / 15): it tries every step
(max - min) / k, k = 15 .. 1, so each block's squared error is at most the reference's, and a
block that lies on a 16-level grid (a dequantized Q4_K sub-block, whose used levels may span
fewer than 16 steps) comes back up to the f16 rounding of d and m; a block on no grid gets
least-squares refits of (d, m).
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GQ
from gguf.quants import dequantize, quantize

from conftest import cached_gguf
from flashllm.ffi.quant import dequantize_rows, quantize_rows
from flashllm.model.tensor import row_bytes

QWEN15 = cached_gguf("qwen2.5-coder-1.5b")   # None: not on this machine (nothing is fetched)


def _gguf_dequant(data: np.ndarray, cols: int) -> np.ndarray:
    return dequantize(data, GQ.Q4_1).reshape(data.shape[0], cols)  # (rows, cols)


def _block_err(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Squared error per block of 32: (rows * cols / 32,)."""
    return ((a.astype(np.float64) - b) ** 2).reshape(-1, 32).sum(-1)


def test_row_bytes_and_gguf_reads_our_bytes():
    assert row_bytes("q4_1", 64) == 40
    x = (np.random.default_rng(1).standard_normal((23, 256)) * 3).astype(np.float32)  # (23, 256)
    ours = quantize_rows(x, "q4_1", n_threads=2)  # (23, 160)
    np.testing.assert_array_equal(dequantize_rows(ours, "q4_1", 256, n_threads=2),
                                  _gguf_dequant(ours, 256))


def test_dequantize_matches_gguf_on_its_bytes():
    x = np.random.default_rng(2).standard_normal((40, 320)).astype(np.float32)  # (40, 320)
    x[0] = 0.0  # d = 0
    x[1, :32] = 1.5  # a constant block
    data = quantize(x, GQ.Q4_1).view(np.uint8).reshape(40, -1)  # (40, 200)
    np.testing.assert_array_equal(dequantize_rows(data, "q4_1", 320), _gguf_dequant(data, 320))


def test_error_is_never_above_the_reference_quantizer():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 256)).astype(np.float32)  # (64, 256)
    x[:8] = rng.standard_t(2, (8, 256))  # heavy tails: a shorter step often wins
    x[8, :32] = 0.0
    ours = dequantize_rows(quantize_rows(x, "q4_1"), "q4_1", 256)  # (64, 256)
    ref = _gguf_dequant(quantize(x, GQ.Q4_1).view(np.uint8).reshape(64, -1), 256)
    e_ours, e_ref = _block_err(ours, x), _block_err(ref, x)  # (512,) each
    assert (e_ours <= e_ref * (1 + 1e-5) + 1e-12).all()
    assert (e_ours < e_ref * 0.99).sum() > 10  # the search does change some blocks


def test_least_squares_refit_lowers_the_error_of_blocks_on_no_grid():
    """Gaussian blocks: the step search alone leaves 0.94 of the reference's squared error
    (measured), the refits of (d, m) bring it to 0.83."""
    x = np.random.default_rng(5).standard_normal((256, 256)).astype(np.float32)  # (256, 256)
    ours = dequantize_rows(quantize_rows(x, "q4_1"), "q4_1", 256)  # (256, 256)
    ref = _gguf_dequant(quantize(x, GQ.Q4_1).view(np.uint8).reshape(256, -1), 256)
    assert _block_err(ours, x).sum() < 0.88 * _block_err(ref, x).sum()


@pytest.mark.parametrize("k", [15, 11, 6, 1])
def test_a_16_level_grid_comes_back(k):
    """Blocks x = d * q + m with f16 d and m, q in 0..k using both ends: exact for k = 15; for a
    shorter span the search may stop at a finer grid that holds every level to f16 rounding
    (k = 1 fits k = 15 with step d / 15), so within the f16 rounding of that step: 15 half-ulps
    of d * k / 15, at most 2^-11 * k * d."""
    rng = np.random.default_rng(k)
    n = 200
    d = rng.uniform(1e-3, 0.1, (n, 1)).astype(np.float16).astype(np.float32)  # (n, 1)
    m = rng.uniform(-1.0, 0.2, (n, 1)).astype(np.float16).astype(np.float32)  # (n, 1)
    q = rng.integers(0, k + 1, (n, 32)).astype(np.float32)  # (n, 32)
    q[:, 0], q[:, 1] = 0, k
    x = d * q + m  # (n, 32)
    back = dequantize_rows(quantize_rows(x, "q4_1"), "q4_1", 32)  # (n, 32)
    if k == 15:
        np.testing.assert_array_equal(back, x)
    bound = 2.0 ** -11 * k * d * (1 + 1e-3)  # (n, 1)
    assert (np.abs(back - x) <= bound).all()


def test_shifted_grid_is_reproduced_to_f16_rounding():
    """Used levels 3..12 of a grid: min and step are not f16 numbers any more, the error is
    their f16 rounding only (q4_0 and the k = 15 fit are off by a good part of a step)."""
    rng = np.random.default_rng(7)
    d = rng.uniform(0.01, 0.05, (300, 1)).astype(np.float32)  # (300, 1)
    q = rng.integers(3, 13, (300, 32)).astype(np.float32)  # (300, 32)
    q[:, 0], q[:, 1] = 3, 12
    x = d * q - 0.3  # (300, 32)
    back = dequantize_rows(quantize_rows(x, "q4_1"), "q4_1", 32)  # (300, 32)
    assert np.abs(back - x).max() <= 2.0 ** -10 * np.abs(x).max()
    ref = _gguf_dequant(quantize(x, GQ.Q4_1).view(np.uint8).reshape(300, -1), 32)
    assert np.abs(ref - x).mean() > 50 * np.abs(back - x).mean()


@pytest.mark.skipif(QWEN15 is None, reason="Qwen2.5-Coder-1.5B's GGUF is not here "
                    "(`flashllm pull qwen2.5-coder-1.5b`, or FLASHLLM_TEST_MODELS)")
def test_a_real_q4_k_tensor_is_reproduced():
    """blk.0.ffn_gate of Qwen2.5-Coder-1.5B Q4_K_M (Q4_K), dequantized by gguf-py: q4_1 keeps it
    to f16 rounding (measured 0.066% mean |error| / mean |w|); q4_0 moves it by 9%."""
    from gguf import GGUFReader
    t = next(t for t in GGUFReader(QWEN15).tensors if t.name == "blk.0.ffn_gate.weight")
    assert t.tensor_type == GQ.Q4_K
    w = dequantize(t.data[:512], GQ.Q4_K).astype(np.float32)  # (512, 1536)
    rel = {dt: float(np.abs(dequantize_rows(quantize_rows(w, dt), dt, w.shape[1]) - w).mean()
                     / np.abs(w).mean()) for dt in ("q4_0", "q4_1")}
    assert rel["q4_1"] < 1e-3 and rel["q4_0"] > 0.05
