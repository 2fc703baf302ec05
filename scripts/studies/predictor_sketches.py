"""Candidates for predictor.py (the predictor study) that the runtime does not ship: low-bit gate/up
sketches (simulated: the weights are quantized, then kept dequantized in f32, so only their
accuracy is measured) and the static hot set (the most frequently active slots, no DRAM).

docs/history/2026-11-28-predictor-studies.md "Cheaper sketches" has the results.
"""
from __future__ import annotations

import numpy as np

from flashllm.sparsity.predictor import Predictor
from flashllm.sparsity.train import qtensor, train_predictor


def rank1_magnitude(w: np.ndarray, iters: int = 6) -> tuple[np.ndarray, np.ndarray]:
    """(s (n, 1), t (1, d)) with |w| ≈ s t in least squares (alternating)."""
    a = np.abs(w).astype(np.float64)                                  # (n, d)
    t = a.mean(axis=0, keepdims=True)                                 # (1, d)
    for _ in range(iters):
        s = (a * t).sum(axis=1, keepdims=True) / (t * t).sum()        # (n, 1)
        t = (a * s).sum(axis=0, keepdims=True) / (s * s).sum()        # (1, d)
    return s, t


def sign_bits(w: np.ndarray, group: int = 0) -> np.ndarray:
    """sign(w) × mean |w| per group of `group` columns (0: per row)."""
    n, d = w.shape
    x = w.reshape(n, d // (group or d), group or d)                   # (n, groups, g)
    return (np.where(x >= 0, 1.0, -1.0) * np.abs(x).mean(axis=2, keepdims=True)).reshape(n, d)


def two_bit(w: np.ndarray) -> np.ndarray:
    """Four symmetric levels ±a, ±3a per row, a picked for the least squared error."""
    sd = np.sqrt((w * w).mean(axis=1, keepdims=True)) + 1e-12        # (n, 1)
    best, err = None, None
    for f in (0.35, 0.45, 0.5, 0.55, 0.65):
        a = f * sd
        q = (np.clip(np.round((w / a - 1) / 2), -2, 1) * 2 + 1) * a   # (n, d)
        e = ((q - w) ** 2).sum(axis=1, keepdims=True)                 # (n, 1)
        best = q if best is None else np.where(e < err, q, best)
        err = e if err is None else np.minimum(e, err)
    return best


def ternary(w: np.ndarray) -> np.ndarray:
    """{-s, 0, +s} per row: zero below 0.7 mean |w|, s the mean magnitude above it."""
    a = np.abs(w)
    keep = a > 0.7 * a.mean(axis=1, keepdims=True)                    # (n, d)
    s = (a * keep).sum(axis=1, keepdims=True) / np.maximum(keep.sum(axis=1, keepdims=True), 1)
    return np.sign(w) * keep * s


def _col_scaled(f):
    def q(w):
        _, t = rank1_magnitude(w)
        return f(w / t) * t
    return q


SKETCHES = {
    "s1": sign_bits,
    "s1g64": lambda w: sign_bits(w, 64),
    "s1rc": lambda w: np.where(w >= 0, 1.0, -1.0) * np.multiply(*rank1_magnitude(w)),
    "s2": two_bit,
    "s2c": _col_scaled(two_bit),
    "t": ternary,
}
BITS = {"s1": 1, "s1g64": 1.25, "s1rc": 1, "s2": 2, "s2c": 2, "t": 1.6}


def sketch_predictor(flash, hs, acts, act_th, quant: str) -> Predictor:
    """gate_up with gate and up replaced by their `quant` sketch (kept as f32)."""
    pred = train_predictor(flash, hs, acts, "gate_up", act_th, dtype="f32")
    for parts in pred.layers:
        for role in ("gate", "up"):
            w = parts[role]
            dense = np.frombuffer(w.data, np.float32).reshape(w.rows, w.cols)   # (n_ff, d)
            parts[role] = qtensor(SKETCHES[quant](dense).astype(np.float32), "f32")
    return pred


class StaticHot:
    """Score = the slot's calibration activation frequency, the same for every token."""

    def __init__(self, masks: list):
        rng = np.random.default_rng(0)
        self.freq = [m.mean(axis=0) + 1e-6 * rng.random(m.shape[1]) for m in masks]  # (n_ff,) each
        self.thresholds = [0.0] * len(masks)
        self.nbytes = 0

    def score(self, layer: int, h: np.ndarray) -> np.ndarray:
        return np.broadcast_to(self.freq[layer], (len(h), len(self.freq[layer])))  # (T, n_ff)

    def predict(self, layer: int, h: np.ndarray) -> np.ndarray:
        return np.flatnonzero(self.freq[layer] >= self.thresholds[layer]).astype(np.int32)
