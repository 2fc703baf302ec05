"""Activation statistics for FFN sparsity: inputs, exact activations, thresholds, frequencies.

The dense model runs over calibration tokens with a recording FFN strategy that hands each
layer's normalized FFN input h (T, d_model) to a callback. From h and the layer's bundles
(dequantized, in slot order) the exact activation of every neuron follows:

    glu_product  |act(gate·h) · (up·h)|      the mask the C kernel applies with `threshold=`
    gate         |act(gate·h)|               CATS
    relu         act(up·h + b)               ReLU models: a neuron is active when > 0
    magnitude    |act(up·h + b)|             other non-GLU models

A per-layer threshold for a target sparsity s is the value below which a fraction s of the
calibration activations lie; a neuron is active for a token when its score ≥ threshold (> 0 for
relu). Everything here works in slots: column j of an activation matrix is slot j of the layer.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from .bundle_write import update_manifest
from .errors import FlashError
from .hotfirst import rewrite_hot_first, write_frequency
from .quant import dequantize_rows

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


# ---- collecting FFN inputs ----------------------------------------------------------------

class RecordingFfn:
    """An FFN strategy that hands each layer's input h (T, d_model) to on_input(layer, h),
    then lets the wrapped strategy compute the FFN as usual."""

    def __init__(self, inner, on_input: Callable[[int, np.ndarray], None]):
        self.inner = inner
        self.on_input = on_input

    def start_pass(self, n_tokens: int, prefill: bool) -> None:
        self.inner.start_pass(n_tokens, prefill)

    def __call__(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        self.on_input(layer, h)
        self.inner(layer, h, x)

    def stats(self) -> dict:
        return {**self.inner.stats(), "recording": True}


def _as_model(model_or_flash, n_threads: int, n_ctx: int):
    if hasattr(model_or_flash, "forward"):
        return model_or_flash
    from .model import Model
    return Model(model_or_flash, n_threads=n_threads, n_ctx=n_ctx)


def run_chunks(model, tokens: Sequence[int], n_ctx: int) -> None:
    """Run the model over tokens in chunks of n_ctx, each from an empty context (logits unused)."""
    ids = np.asarray(tokens, dtype=np.int32)                      # (N,)
    step = min(n_ctx, model.n_ctx)
    for start in range(0, len(ids), step):
        model.reset()
        model.forward(ids[start:start + step], 0, last_only=True)


def collect_ffn_inputs(model_or_flash, tokens: Sequence[int], n_ctx: int = 512,
                       n_threads: int = 1,
                       on_input: Optional[Callable[[int, np.ndarray], None]] = None):
    """Run the dense model over tokens (chunks of n_ctx from an empty context) and collect
    every layer's FFN input h.

    model_or_flash: a Model (its FFN strategy is wrapped for the run, then restored) or a
    FlashModel (a dense Model is built). With on_input, each chunk's h (T, d_model) of each layer
    goes to on_input(layer, h) as it is made (memory stays bounded) and None is returned;
    without it, returns per layer an (N, d_model) f32 array."""
    model = _as_model(model_or_flash, n_threads, n_ctx)
    cfg, n = model.config, len(tokens)
    if n == 0:
        raise CalibrationError("no calibration tokens")
    store = None
    if on_input is None:
        store = [np.empty((n, cfg.d_model), np.float32) for _ in range(cfg.n_layers)]  # (N, d)
        filled = [0] * cfg.n_layers

        def on_input(layer: int, h: np.ndarray) -> None:
            k = filled[layer]
            store[layer][k:k + len(h)] = h
            filled[layer] = k + len(h)

    inner = model.ffn
    model.ffn = RecordingFfn(inner, on_input)
    try:
        run_chunks(model, tokens, n_ctx)
    finally:
        model.ffn = inner
        model.reset()
    return store


# ---- exact activations ---------------------------------------------------------------------

@dataclass
class FfnWeights:
    """One layer's FFN input weights dequantized to f32, rows in slot order."""
    gate: Optional[np.ndarray]     # (n_ff, d_model), None for non-GLU models
    up: np.ndarray                 # (n_ff, d_model)
    up_bias: Optional[np.ndarray]  # (n_ff,) indexed by slot, or None
    act: str


def ffn_weights(flash, layer: int, n_threads: int = 1) -> FfnWeights:
    """Gate/up rows of layer's bundles (flash.read_ffn_layer), dequantized, in slot order."""
    cfg, f = flash.config, flash.ffn
    bundles = flash.read_ffn_layer(layer)                         # (n_ff, stride) uint8
    pb = f.part_bytes
    parts = [dequantize_rows(bundles[:, k * pb:(k + 1) * pb], f.dtype, f.d_model, n_threads)
             for k in range(2 if cfg.glu else 1)]                 # each (n_ff, d_model)
    gate, up = (parts[0], parts[1]) if cfg.glu else (None, parts[0])
    bias = None
    name = f"blk.{layer}.ffn_up.bias"
    if flash.has(name):
        bias = np.asarray(flash.tensor(name), np.float32)         # (n_ff,) by neuron id
        if f.neuron_order is not None:
            bias = bias[f.neuron_order[layer]]                    # (n_ff,) by slot
    return FfnWeights(gate, up, bias, cfg.act)


def activation(x: np.ndarray, act: str) -> np.ndarray:
    """act(x) elementwise in f32: silu, relu or the exact (erf) gelu."""
    if act == "silu":
        return x / (1.0 + np.exp(-x))
    if act == "relu":
        return np.maximum(x, 0.0)
    if act == "gelu":
        return 0.5 * x * (1.0 + _erf(x * np.float32(0.5 ** 0.5)))
    raise CalibrationError(f"unknown activation {act!r}")


def _erf(x: np.ndarray) -> np.ndarray:
    """erf by Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7; numpy has no erf)."""
    s, a = np.sign(x), np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027
                                                                          + t * 1.061405429))))
    return s * (1.0 - poly * np.exp(-a * a))


def ffn_activations(flash, layer: int, h: np.ndarray, criterion: str = "glu_product",
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


# ---- the whole calibration -----------------------------------------------------------------

def hot_share(freq: np.ndarray, top: float = 0.2) -> float:
    """Share of all activations that fall on the `top` fraction of most frequent slots."""
    f = np.sort(np.asarray(freq, np.float64))[::-1]                # (n_ff,)
    total = f.sum()
    return float(f[:max(1, int(round(top * f.size)))].sum() / total) if total > 0 else 0.0


def layer_statistics(flash, inputs, sparsity: float, criterion: str, n_threads: int = 1,
                     log: Callable[[str], None] = lambda m: None):
    """Per layer from its FFN inputs (N, d_model): threshold, per-slot frequency, achieved
    sparsity. Returns (thresholds [L], freq (L, n_ff) f64, achieved [L])."""
    check_criterion(flash.config, criterion)
    thresholds, freqs, achieved = [], [], []
    for layer, h in enumerate(inputs):
        scores = ffn_activations(flash, layer, h, criterion, n_threads=n_threads)  # (N, n_ff)
        t = 0.0 if criterion == "relu" else threshold(scores, sparsity)
        freq = frequencies(scores, t, criterion)                                    # (n_ff,)
        thresholds.append(t)
        freqs.append(freq)
        achieved.append(1.0 - float(freq.mean()))
        log(f"layer {layer}: threshold {t:.4g}, sparsity {achieved[-1]:.3f}, "
            f"hottest 20% carry {hot_share(freq):.2f}")
    return thresholds, np.stack(freqs), achieved


def calibrate_model(flash, tokens: Sequence[int], text: dict, sparsity: float,
                    criterion: Optional[str] = None, n_ctx: int = 512, reorder: bool = True,
                    n_threads: int = 1, log: Callable[[str], None] = lambda m: None,
                    predictor: Optional[str] = None) -> dict:
    """Calibrate the model folder of `flash` on tokens: thresholds for the target sparsity,
    per-slot frequencies, (reorder) the hot-first FFN rewrite, and (predictor: a kind of
    flashllm.predictor_train) a trained predictor. Writes and returns the manifest's sparsity
    section; the model stays valid if this is interrupted."""
    criterion = criterion or default_criterion(flash.config)
    check_criterion(flash.config, criterion)
    inputs = collect_ffn_inputs(flash, tokens, n_ctx=n_ctx, n_threads=n_threads)
    thresholds, freq, achieved = layer_statistics(flash, inputs, sparsity, criterion, n_threads, log)
    ids = np.asarray(tokens, dtype="<i4")                          # (N,)
    section = {"criterion": criterion, "target": sparsity, "thresholds": thresholds,
               "achieved": achieved,
               "calibration": {"text": text, "n_tokens": len(ids), "n_ctx": n_ctx,
                               "tokens_sha256": hashlib.sha256(ids.tobytes()).hexdigest()},
               "hot_first": False,
               "frequency": {"hot20_share": [hot_share(f) for f in freq],
                             "never_active": [int((f == 0).sum()) for f in freq]}}
    if reorder:
        section = rewrite_hot_first(flash, freq, section)
    else:
        old = (flash.manifest.get("sparsity", {}).get("frequency") or {}).get("file")
        section["frequency"].update(write_frequency(flash.path, freq, old))
        update_manifest(flash.path, sparsity=section)
        if old and old != section["frequency"]["file"]:
            (flash.path / old).unlink(missing_ok=True)
    if predictor:
        fit_predictor(flash.path, inputs, thresholds, criterion, predictor, n_threads, log)
    return section


def fit_predictor(path, inputs, thresholds: list, criterion: str, kind: str, n_threads: int,
                  log: Callable[[str], None]) -> None:
    """Train a `kind` predictor on the calibration inputs h (per layer (N, d_model)) against the
    thresholded masks, in the model's current slot order (after any hot-first rewrite), at 95%
    recall, and store it in the model folder."""
    from .bundle import open_flash
    from .predictor import save_predictor
    from .predictor_train import DEFAULT_OPTIONS, train_predictor
    flash = open_flash(path)                                       # the reordered slots
    acts = [ffn_activations(flash, i, h, criterion, n_threads=n_threads)  # (N, n_ff) each
            for i, h in enumerate(inputs)]
    pred = train_predictor(flash, inputs, acts, kind, thresholds, recall=0.95,
                           n_threads=n_threads, **DEFAULT_OPTIONS.get(kind, {}))
    save_predictor(path, pred, pred.metrics)
    m = pred.metrics
    log(f"predictor {kind}: held-out recall {np.mean(m['recall']):.3f}, precision "
        f"{np.mean(m['precision']):.3f}, load {np.mean(m['load']):.3f}, "
        f"{pred.nbytes / 2**20:.1f} MiB in DRAM")


def text_tokens(tok, text: str, n_tokens: Optional[int] = None) -> list[int]:
    """text tokenized with the model's special tokens (BOS when it adds one), cut to n_tokens."""
    ids = tok.encode(text, add_special=True)
    if n_tokens is not None:
        if len(ids) < n_tokens:
            raise CalibrationError(f"the text has {len(ids)} tokens, {n_tokens} were asked for")
        ids = ids[:n_tokens]
    return ids


def thresholds_for(flash, sparsity: float, calibration_tokens: Callable[[], Sequence[int]],
                   n_ctx: int = 512, n_threads: int = 1,
                   log: Callable[[str], None] = lambda m: None) -> list[float]:
    """Per-layer kernel thresholds for a target sparsity: the model's own when it was calibrated
    for that target with a criterion the kernel applies, else computed now (nothing written)
    on calibration_tokens() with the model's default criterion."""
    sec = flash.manifest.get("sparsity") or {}
    if sec.get("target") == sparsity and sec.get("criterion") in ("glu_product", "relu", "magnitude"):
        log(f"using the model's calibrated thresholds (target {sparsity}, {sec['criterion']})")
        return [float(t) for t in sec["thresholds"]]
    criterion = default_criterion(flash.config)
    tokens = calibration_tokens()
    log(f"calibrating thresholds for sparsity {sparsity} on {len(tokens)} tokens ({criterion})")
    inputs = collect_ffn_inputs(flash, tokens, n_ctx=n_ctx, n_threads=n_threads)
    return layer_statistics(flash, inputs, sparsity, criterion, n_threads)[0]


def manifest_thresholds(manifest: dict, n_layers: int) -> list[float]:
    """Per-layer magnitude thresholds of the manifest's sparsity section; zeros when absent."""
    t = manifest.get("sparsity", {}).get("thresholds")
    return [float(v) for v in t] if t and len(t) == n_layers else [0.0] * n_layers


def exact_active(flash, layer: int, h: np.ndarray, threshold: float) -> np.ndarray:
    """(a,) the neurons (slots) of layer active for any row of h (T, d_model) at threshold, from
    the layer's weights under the manifest's criterion (slow: dequantizes the layer)."""
    crit = flash.manifest.get("sparsity", {}).get("criterion") or default_criterion(flash.config)
    scores = ffn_activations(flash, layer, h, crit)                      # (T, n_ff)
    return np.flatnonzero(active_mask(scores, threshold, crit).any(axis=0))  # (a,)
