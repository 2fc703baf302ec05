"""A layer's calibration statistics in memory that does not grow with the model.

calibrate.target_statistics dequantizes a whole layer to f32 ((2 n_ff, d_model): 110 MB on
Qwen2.5-Coder-1.5B) and sorts a copy of its scores. Here the gate / up rows are dequantized
BLOCK_NEURONS slots at a time and multiplied BLOCK_TOKENS inputs at a time into one reused
(N, n_ff) f32 score array; the per-target thresholds are the same k-th smallest scores as
activations.threshold's, found by a radix select over the scores' bits (two histograms, no copy:
the scores are non-negative, so their f32 bit patterns sort as their values), and frequencies
and contributions are summed block by block. The numbers are activations.py's (the products
block by block: float noise).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from flashllm.sparsity.activations import (check_criterion, down_norms, ffn_activations,
                                           ffn_weights, hot_share)

BLOCK_NEURONS = 256       # slots dequantized at a time: (2 x 256, d_model) f32
BLOCK_TOKENS = 2048       # inputs multiplied at a time: (2048, 256) f32 products (numpy's
                          # 2-thread GEMM wastes CPU on few rows: 40 GFLOP a CPU-s on (512, 1024),
                          # 75 on (2048, 256), the same product size; the same bits)
SUM_TOKENS = 512          # tokens a partial sum adds (counts, |h| sums) before the next
SELECT_STEP = 1 << 21     # score entries a histogram step reads


def kth_smallest(scores: np.ndarray, ks: Sequence[int]) -> dict:
    """{k: the k-th smallest (0-based) entry} of non-negative f32 scores (any shape, C order),
    each 0 <= k < scores.size, by a radix select on the bits (high 16, then low 16)."""
    bits = scores.reshape(-1).view(np.uint32)                             # (size,)
    steps = range(0, bits.size, SELECT_STEP)
    hi = sum(np.bincount(bits[j:j + SELECT_STEP] >> 16, minlength=1 << 16) for j in steps)
    cum = np.cumsum(hi)                                                   # (65536,)
    need: dict = {}
    for k in ks:
        b = int(np.searchsorted(cum, k, side="right"))
        need.setdefault(b, []).append((k, k - (int(cum[b - 1]) if b else 0)))
    out = {}
    for b, items in need.items():
        lo = np.zeros(1 << 16, np.int64)                                  # (65536,)
        for j in steps:
            blk = bits[j:j + SELECT_STEP]
            lo += np.bincount(blk[(blk >> 16) == b] & 0xFFFF, minlength=1 << 16)
        cl = np.cumsum(lo)
        for k, r in items:
            low = int(np.searchsorted(cl, r, side="right"))
            out[k] = float(np.array([(b << 16) | low], np.uint32).view(np.float32)[0])
    return out


def thresholds_of(scores: np.ndarray, targets: Sequence[float]) -> dict:
    """{target: activations.threshold(scores, target)} of non-negative scores, no copy made."""
    size, ks = scores.size, {}
    for s in targets:
        ks[s] = int(round(s * size))
    inner = kth_smallest(scores, [k for k in ks.values() if 0 < k < size])
    top = lambda: float(np.nextafter(scores.max(), np.float32(np.inf)))   # noqa: E731
    return {s: 0.0 if k == 0 or size == 0 else top() if k >= size else inner[k]
            for s, k in ks.items()}


def layer_scores(flash, layer: int, h: np.ndarray, criterion: str, n_threads: int = 1,
                 out=None, bundles=None, mag=None) -> np.ndarray:
    """activations.ffn_activations of layer for h (N, d_model) into out (N, n_ff) f32 (made when
    None), block by block (module doc); mag (n_ff,) f64, when given, gets each slot's sum over
    the tokens of |h| (glu_product's score; criterion gate scores |act(g)| only)."""
    n_ff = flash.config.n_ff
    out = np.empty((len(h), n_ff), np.float32) if out is None else out    # (N, n_ff)
    bundles = flash.read_ffn_layer(layer) if bundles is None else bundles  # (n_ff, stride)
    for s0 in range(0, n_ff, BLOCK_NEURONS):
        s1 = min(s0 + BLOCK_NEURONS, n_ff)
        w = ffn_weights(flash, layer, n_threads, bundles[s0:s1])
        if w.up_bias is not None:
            w.up_bias = w.up_bias[s0:s1]
        for t0 in range(0, len(h), BLOCK_TOKENS):
            part = ffn_activations(flash, layer, h[t0:t0 + BLOCK_TOKENS], criterion,
                                   weights=w)                              # (T, s1 - s0)
            out[t0:t0 + len(part), s0:s1] = part
            if mag is not None:
                m = ffn_activations(flash, layer, h[t0:t0 + BLOCK_TOKENS], "glu_product",
                                    weights=w) if criterion == "gate" else part
                for r in range(0, len(m), SUM_TOKENS):       # the f64 sums in a fixed order
                    mag[s0:s1] += m[r:r + SUM_TOKENS].sum(axis=0, dtype=np.float64)
    return out


class LayerStats:
    """Per layer, from its FFN inputs of all calibration tokens (add(layer, h)): for each
    target its threshold, per-slot frequency and achieved sparsity; each slot's contribution
    (with contributions). result() as calibrate.target_statistics returns them."""

    def __init__(self, flash, targets: Sequence[float], criterion: str, n_tokens: int,
                 n_threads: int = 1, contributions: bool = False,
                 log: Callable[[str], None] = lambda m: None):
        check_criterion(flash.config, criterion)
        self.flash, self.targets, self.criterion = flash, list(targets), criterion
        self.n_threads, self.contributions, self.log = n_threads, contributions, log
        self.scores = np.empty((n_tokens, flash.config.n_ff), np.float32)   # (N, n_ff) reused
        self.per = {t: ([], [], []) for t in self.targets}     # target -> thresholds, freqs, achieved
        self.contrib: list = []

    def add(self, layer: int, h: np.ndarray) -> None:
        """Layer's statistics from its FFN inputs h (N, d_model)."""
        bundles = self.flash.read_ffn_layer(layer)                         # (n_ff, stride) uint8
        mag = self._score(layer, h, bundles)                               # (n_ff,) f64 or None
        crit, s = self.criterion, self.scores
        ths = {t: 0.0 for t in self.targets} if crit == "relu" else thresholds_of(s, self.targets)
        for target, (t_list, freqs, achieved) in self.per.items():
            freq = self._counts(ths[target]) / len(s)                      # (n_ff,) f64
            t_list.append(ths[target])
            freqs.append(freq)
            achieved.append(1.0 - float(freq.mean()))
        if mag is not None:       # activations.contribution: E|h| * ||down||
            self.contrib.append(mag / len(s) * down_norms(self.flash, layer, self.n_threads,
                                                          bundles))
        t_list, freqs, achieved = self.per[self.targets[0]]
        self.log(f"layer {layer}: threshold {t_list[-1]:.4g}, sparsity {achieved[-1]:.3f}, "
                 f"hottest 20% carry {hot_share(freqs[-1]):.2f}")

    def _score(self, layer: int, h: np.ndarray, bundles: np.ndarray):
        """Fill self.scores (N, n_ff) for layer; (n_ff,) f64 sums of |h| when contributions."""
        mag = np.zeros(self.flash.config.n_ff) if self.contributions else None  # (n_ff,)
        layer_scores(self.flash, layer, h, self.criterion, self.n_threads, self.scores,
                     bundles, mag)
        return mag

    def _counts(self, t: float) -> np.ndarray:
        """(n_ff,) f64 how many tokens each slot is active for at threshold t."""
        n = np.zeros(self.scores.shape[1])                                 # (n_ff,)
        for t0 in range(0, len(self.scores), SUM_TOKENS):
            blk = self.scores[t0:t0 + SUM_TOKENS]                          # (T, n_ff)
            n += (blk > 0 if self.criterion == "relu" else blk >= t).sum(axis=0)
        return n

    def result(self):
        """({target: (thresholds [L], freq (L, n_ff) f64, achieved [L])}, contribution (L,
        n_ff) f64 or None)."""
        stats = {t: (ths, np.stack(f), a) for t, (ths, f, a) in self.per.items()}
        return stats, np.stack(self.contrib) if self.contributions else None


class InputStore:
    """Every layer's FFN inputs (N, d_model) f32 kept on disk, not in DRAM, for the predictor
    trained after the hot-first rewrite: an unnamed temporary file beside the model folder
    (gone when the process ends, however it ends). Sequence-like: store[i] reads layer i."""

    def __init__(self, folder, n_layers: int, n_tokens: int, d_model: int):
        import tempfile
        self.shape, self.n_layers = (n_tokens, d_model), n_layers
        self.file = tempfile.TemporaryFile(dir=folder)

    def put(self, layer: int, h: np.ndarray) -> None:
        self.file.seek(layer * h.size * 4)
        np.ascontiguousarray(h, "<f4").tofile(self.file)

    def __len__(self) -> int:
        return self.n_layers

    def __getitem__(self, layer: int) -> np.ndarray:
        n = self.shape[0] * self.shape[1]
        self.file.seek(layer * n * 4)
        return np.fromfile(self.file, "<f4", count=n).reshape(self.shape)   # (N, d_model)

    def close(self) -> None:
        self.file.close()


class LastLayer:
    """Sequence-like per-layer values made on demand by make(i), the last one kept (a
    predictor's trainer asks for a layer's more than once, one layer after another)."""

    def __init__(self, n: int, make: Callable[[int], np.ndarray]):
        self.n, self.make, self.last = n, make, (None, None)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if self.last[0] != i:
            self.last = (None, None)          # the previous layer's freed before the next's
            self.last = (i, self.make(i))
        return self.last[1]
