"""FFN activations and the sparsity they give: scores, thresholds, masks, frequencies.

From a layer's normalized FFN input h (T, d_model) and its bundles (dequantized, in slot order)
the exact activation of every neuron follows:

    glu_product  |act(gate·h) · (up·h)|      the mask the C kernel applies with `threshold=`
    gate         |act(gate·h)|               CATS
    relu         act(up·h + b)               ReLU models: a neuron is active when > 0
    magnitude    |act(up·h + b)|             other non-GLU models

A per-layer threshold for a target sparsity s is the value below which a fraction s of the
calibration activations lie; a neuron is active for a token when its score ≥ threshold (> 0 for
relu). Everything here works in slots: column j of an activation matrix is slot j of the layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from flashllm.errors import FlashError
from flashllm.ffi.quant import dequantize_rows
from flashllm.format.reader import FlashModel
from flashllm.model.tensor import row_bytes
from flashllm.model.archs.tensors import BY_FIELD

CRITERIA = ("glu_product", "gate", "relu", "magnitude")


class CalibrationError(FlashError):
    """Calibration cannot run as asked (too few tokens, a criterion the model cannot use, ...)."""


def default_criterion(cfg) -> str:
    """glu_product for GLU models, relu for ReLU models, magnitude otherwise."""
    if cfg.glu:
        return "glu_product"
    return "relu" if cfg.act == "relu" else "magnitude"


def check_criterion(cfg, criterion: str) -> None:
    if criterion not in CRITERIA:
        raise CalibrationError(f"unknown sparsity criterion {criterion!r} "
                               f"(expected one of {', '.join(CRITERIA)})")
    if cfg.glu != (criterion in ("glu_product", "gate")):
        kind = "a GLU" if cfg.glu else "a non-GLU"
        raise CalibrationError(f"criterion {criterion!r} does not apply to {kind} model")


@dataclass
class FfnWeights:
    """One layer's FFN input weights dequantized to f32, rows in slot order."""
    gate: Optional[np.ndarray]     # (n_ff, d_model), None for non-GLU models
    up: np.ndarray                 # (n_ff, d_model)
    up_bias: Optional[np.ndarray]  # (n_ff,) indexed by slot, or None
    act: str


def ffn_weights(flash: FlashModel, layer: int, n_threads: int = 1,
                bundles: Optional[np.ndarray] = None) -> FfnWeights:
    """Gate/up rows of layer's bundles (flash.read_ffn_layer unless given), dequantized, in slot
    order."""
    cfg, f = flash.config, flash.ffn
    if bundles is None:
        bundles = flash.read_ffn_layer(layer)                     # (n_ff, stride) uint8
    pb = f.part_bytes
    parts = [dequantize_rows(bundles[:, k * pb:(k + 1) * pb], f.dtype, f.d_model, n_threads)
             for k in range(2 if cfg.glu else 1)]                 # each (n_ff, d_model)
    gate, up = (parts[0], parts[1]) if cfg.glu else (None, parts[0])
    bias = None
    name = BY_FIELD["up_b"].at(layer)
    if flash.has(name):
        bias = np.asarray(flash.tensor(name), np.float32)         # (n_ff,) by neuron id
        if f.neuron_order is not None:
            bias = bias[f.neuron_order[layer]]                    # (n_ff,) by slot
    return FfnWeights(gate, up, bias, cfg.act)


def activation(x: np.ndarray, act: str) -> np.ndarray:
    """act(x) elementwise in f32: silu, relu, the exact (erf) gelu or its tanh approximation."""
    if act == "silu":
        return x / (1.0 + np.exp(-x))
    if act == "relu":
        return np.maximum(x, 0.0)
    if act == "gelu":
        return 0.5 * x * (1.0 + _erf(x * np.float32(0.5 ** 0.5)))
    if act == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(np.float32((2 / np.pi) ** 0.5) * (x + np.float32(0.044715) * x ** 3)))
    raise CalibrationError(f"unknown activation {act!r}")


def _erf(x: np.ndarray) -> np.ndarray:
    """erf by Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7; numpy has no erf)."""
    s, a = np.sign(x), np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027
                                                                          + t * 1.061405429))))
    return s * (1.0 - poly * np.exp(-a * a))


def ffn_activations(flash: FlashModel, layer: int, h: np.ndarray, criterion: str = "glu_product",
                    weights: Optional[FfnWeights] = None, n_threads: int = 1) -> np.ndarray:
    """Scores (T, n_ff) f32 of every slot of `layer` for inputs h (T, d_model) under criterion
    (see the module doc); pass `weights` (ffn_weights) to avoid dequantizing again."""
    w = weights or ffn_weights(flash, layer, n_threads)
    h = np.asarray(h, np.float32)                                  # (T, d_model)
    with np.errstate(over="ignore"):
        if criterion in ("glu_product", "gate"):
            if w.gate is None:
                raise CalibrationError(f"criterion {criterion!r} needs a GLU model")
            g = activation(h @ w.gate.T, w.act)                    # (T, n_ff)
            if criterion == "gate":
                return np.abs(g)
            u = h @ w.up.T                                         # (T, n_ff)
            if w.up_bias is not None:
                u += w.up_bias
            return np.abs(g * u)
        u = h @ w.up.T                                             # (T, n_ff)
        if w.up_bias is not None:
            u += w.up_bias
        a = activation(u, w.act)                                   # (T, n_ff)
        if criterion == "relu":
            return a
        if criterion == "magnitude":
            return np.abs(a)
    raise CalibrationError(f"unknown sparsity criterion {criterion!r}")


# ---- thresholds and frequencies ------------------------------------------------------------

def threshold(scores: np.ndarray, sparsity: float) -> float:
    """The smallest t such that a fraction `sparsity` (rounded to whole entries) of scores lies
    strictly below t: the k-th smallest score, k = round(sparsity · scores.size)."""
    if not 0.0 <= sparsity <= 1.0:
        raise CalibrationError(f"sparsity must be in [0, 1], got {sparsity}")
    flat = np.asarray(scores, np.float32).ravel()                  # (N * n_ff,)
    k = int(round(sparsity * flat.size))
    if k == 0 or flat.size == 0:
        return 0.0
    if k >= flat.size:
        return float(np.nextafter(flat.max(), np.float32(np.inf)))
    return float(np.partition(flat, k)[k])


def layer_thresholds(acts: Sequence[np.ndarray], sparsity: float) -> list[float]:
    """Per layer the threshold of `threshold` over that layer's scores (N, n_ff)."""
    return [threshold(a, sparsity) for a in acts]


def active_mask(scores: np.ndarray, thresh: float, criterion: str) -> np.ndarray:
    """(T, n_ff) bool: score ≥ threshold, or > 0 under the relu criterion."""
    return scores > 0 if criterion == "relu" else scores >= thresh


def frequencies(scores: np.ndarray, thresh: float, criterion: str) -> np.ndarray:
    """(n_ff,) f64 fraction of tokens for which each slot is active."""
    return active_mask(scores, thresh, criterion).mean(axis=0, dtype=np.float64)


def hot_share(freq: np.ndarray, top: float = 0.2) -> float:
    """Share of all activations that fall on the `top` fraction of most frequent slots."""
    f = np.sort(np.asarray(freq, np.float64))[::-1]                # (n_ff,)
    total = f.sum()
    return float(f[:max(1, int(round(top * f.size)))].sum() / total) if total > 0 else 0.0


def down_norms(flash: FlashModel, layer: int, n_threads: int = 1, bundles: Optional[np.ndarray] = None,
               chunk: int = 2048) -> np.ndarray:
    """(n_ff,) f32 the L2 norm of each slot's down column (dequantized chunk slots at a time),
    from the layer's bundles (flash.read_ffn_layer unless given)."""
    cfg, f = flash.config, flash.ffn
    if bundles is None:
        bundles = flash.read_ffn_layer(layer)                     # (n_ff, stride) uint8
    off, ddt = f.down_offset, f.down_dtypes[layer]
    cols = bundles[:, off:off + row_bytes(ddt, cfg.d_model)]      # (n_ff, down bytes)
    return np.concatenate([np.linalg.norm(dequantize_rows(np.ascontiguousarray(cols[i:i + chunk]),
                                                          ddt, cfg.d_model, n_threads), axis=1)
                           for i in range(0, len(cols), chunk)]).astype(np.float32)


def contribution(magnitudes: np.ndarray, norms: np.ndarray) -> np.ndarray:
    """(n_ff,) f64 each slot's expected contribution to its layer's output, E_t |h_t| * ||down||,
    from |h| (N, n_ff) over calibration tokens and the down columns' norms (n_ff,): the order
    the caches hold neurons in (what dropping a neuron costs a token that does without it)."""
    return magnitudes.mean(axis=0, dtype=np.float64) * norms


def manifest_thresholds(manifest: dict, n_layers: int) -> list[float]:
    """Per-layer magnitude thresholds of the manifest's sparsity section; zeros when absent."""
    t = manifest.get("sparsity", {}).get("thresholds")
    return [float(v) for v in t] if t and len(t) == n_layers else [0.0] * n_layers


def exact_active(flash: FlashModel, layer: int, h: np.ndarray, threshold: float) -> np.ndarray:
    """(a,) the neurons (slots) of layer active for any row of h (T, d_model) at threshold, from
    the layer's weights under the manifest's criterion (slow: dequantizes the layer)."""
    crit = flash.manifest.get("sparsity", {}).get("criterion") or default_criterion(flash.config)
    scores = ffn_activations(flash, layer, h, crit)                      # (T, n_ff)
    return np.flatnonzero(active_mask(scores, threshold, crit).any(axis=0))  # (a,)
