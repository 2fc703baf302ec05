"""Building and training predictors (flashllm.sparsity.predictor) from calibration data, in numpy.

Inputs per layer: h (N, d_model) FFN inputs over calibration tokens and acts (N, n_ff) the exact
|act(g)·u| per slot; the true mask of a layer is acts >= act_threshold[l] (the sparsity
calibration's threshold). A predictor's own threshold is then set on calibration tokens for a
recall target (share of true-active (token, slot) pairs predicted) or a load target (share of
slots predicted per token).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from flashllm.ffi import quant
from flashllm.format.layout import tensor_dtype
from flashllm.format.reader import FlashModel
from flashllm.errors import FlashError
from flashllm.sparsity.activations import ffn_weights
from flashllm.sparsity.predictor import KINDS, Predictor
from flashllm.model.tensor import QTensor


# what `flashllm calibrate` trains unless told otherwise: the best perplexity at equal load in
# scripts/studies/predictor.py (docs/PREDICTOR.md); ReLU / non-GLU models fall back to lowrank
DEFAULT_KIND = {"glu": "gate_up", "plain": "lowrank"}
DEFAULT_OPTIONS = {"gate_up": {"dtype": "q4_0"}, "lowrank": {"rank": 128, "dtype": "q8_0", "pin": 16}}
PIN_LOGIT = 1e4      # the bias of a pinned slot: predicted active whatever the input


class TrainError(FlashError):
    """Calibration data or settings a predictor cannot be built from."""


def qtensor(x: np.ndarray, dtype: str) -> QTensor:
    """x (rows, cols) f32 stored as dtype (f16 when a quantized dtype does not fit the cols)."""
    dt = tensor_dtype(dtype, x.shape)
    return QTensor(quant.quantize_rows(x, dt, n_threads=1), dt, *x.shape)


def threshold_for(scores: np.ndarray, mask: np.ndarray, recall: Optional[float] = None,
                  load: Optional[float] = None) -> float:
    """The score threshold giving `recall` of mask's true pairs, or `load` share of slots."""
    if (recall is None) == (load is None):
        raise TrainError("give exactly one of recall and load")
    target = recall if recall is not None else load
    if not 0.0 < target <= 1.0:
        raise TrainError(f"recall/load must be in (0, 1], got {target}")
    pool = scores[mask] if recall is not None else scores.reshape(-1)     # (k,)
    if pool.size == 0:
        return float(np.max(scores)) + 1.0
    return float(np.quantile(pool, 1.0 - target, method="lower"))


def lowrank_fit(w: np.ndarray, h: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(Ub (n, r), Ua (r, d)) with Ub Ua h ≈ w h best in the mean square over the rows of h (N, d)."""
    cov = h.T.astype(np.float64) @ h / len(h)                             # (d, d)
    # a ridge relative to the inputs' scale: a LayerNorm's outputs lie near a hyperplane (OPT),
    # and an absolute 1e-6 left their float covariance not positive definite
    cov += max(1e-6 * np.trace(cov) / len(cov), 1e-12) * np.eye(len(cov))
    chol = np.linalg.cholesky(cov)                                        # (d, d) lower
    p, s, qt = np.linalg.svd(w.astype(np.float64) @ chol, full_matrices=False)
    r = min(rank, len(s))
    ua = np.linalg.solve(chol.T, qt[:r].T).T                              # (r, d) = Q_r^T L^-1
    return (p[:, :r] * s[:r]).astype(np.float32), ua.astype(np.float32)


def lstsq_weights(h: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """(n, d) least-squares W with W h ≈ mask - mean over the tokens h (N, d): with lowrank_fit
    on it, the reduced-rank regression start of the low-rank predictor (the SVD of W_gate
    predicts g, whose sign says little about |act(g)·u|)."""
    y = mask.astype(np.float32) - mask.mean(axis=0, dtype=np.float32)   # (N, n)
    cov = h.T.astype(np.float64) @ h / len(h)                            # (d, d)
    cov += 1e-4 * np.trace(cov) / len(cov) * np.eye(len(cov))
    return np.linalg.solve(cov, h.T @ y / len(h)).T.astype(np.float32)   # (n, d)


def train_lowrank(h: np.ndarray, mask: np.ndarray, a: np.ndarray, b: np.ndarray,
                  bias: np.ndarray, epochs: int = 8, lr: float = 3e-3, batch: int = 128,
                  seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Adam on the balanced BCE of sigmoid(b + B A h) vs mask (N, n_ff); returns (A, B, bias)."""
    rng = np.random.default_rng(seed)
    params = [a.astype(np.float32).copy(), b.astype(np.float32).copy(),
              bias.astype(np.float32).copy()]                             # (r, d), (n, r), (n,)
    m1 = [np.zeros_like(p) for p in params]
    m2 = [np.zeros_like(p) for p in params]
    pos = float(np.clip(mask.mean(), 1e-3, 1 - 1e-3))
    w_pos, w_neg = 0.5 / pos, 0.5 / (1.0 - pos)
    step = 0
    for _ in range(epochs):
        for idx in np.array_split(rng.permutation(len(h)), max(1, len(h) // batch)):
            x, y = h[idx], mask[idx].astype(np.float32)                   # (B, d), (B, n)
            z = x @ params[0].T                                           # (B, r)
            logit = z @ params[1].T + params[2]                           # (B, n)
            prob = 1.0 / (1.0 + np.exp(-np.clip(logit, -30, 30)))         # (B, n)
            g = (prob - y) * (y * w_pos + (1 - y) * w_neg) / y.size       # (B, n) dLoss/dlogit
            grads = [(g @ params[1]).T @ x, g.T @ z, g.sum(axis=0)]      # (r, d), (n, r), (n,)
            step += 1
            for p, gr, u, v in zip(params, grads, m1, m2):
                u *= 0.9
                u += 0.1 * gr
                v *= 0.999
                v += 0.001 * gr * gr
                p -= lr * (u / (1 - 0.9 ** step)) / (np.sqrt(v / (1 - 0.999 ** step)) + 1e-8)
    return params[0], params[1], params[2]


def layer_parts(kind: str, gate: Optional[np.ndarray], up: np.ndarray, h: np.ndarray,
                mask: np.ndarray, rank: int, dtype: str, epochs: int) -> dict:
    """One layer's predictor parts of `kind` (see flashllm.sparsity.predictor) fitted to h (N, d)."""
    if kind != "lowrank" and gate is None:
        raise TrainError(f"a {kind} predictor needs a gated (GLU) FFN")
    if kind == "gate":
        return {"gate": qtensor(gate, dtype)}
    if kind == "gate_up":
        return {"gate": qtensor(gate, dtype), "up": qtensor(up, dtype)}
    if kind in ("gate_lrup", "lr_gate_up"):
        ub, ua = lowrank_fit(up, h, rank)                                 # (n, r), (r, d)
        out = {"up_a": qtensor(ua, "q8_0"), "up_b": qtensor(ub, "q8_0")}
        if kind == "gate_lrup":
            return {"gate": qtensor(gate, dtype), **out}
        gb, ga = lowrank_fit(gate, h, rank)                               # (n, r), (r, d)
        return {"gate_a": qtensor(ga, "q8_0"), "gate_b": qtensor(gb, "q8_0"), **out}
    b, a = lowrank_fit(lstsq_weights(h, mask), h, rank)                  # (n, r), (r, d)
    scale = 1.0 / max(float(np.std(h @ a.T @ b.T)), 1e-6)
    bias = -np.quantile(h @ a.T @ b.T * scale, 1.0 - mask.mean(), axis=0)  # (n,) start at the rate
    if epochs:
        a, b, bias = train_lowrank(h, mask, a, b * scale, bias.astype(np.float32), epochs)
    else:
        b = b * scale
    return {"a": qtensor(a, dtype), "b": qtensor(b, dtype), "bias": bias.astype(np.float32)}


def train_predictor(flash: FlashModel, h_by_layer: list, acts_by_layer: list, kind: str,
                    act_thresholds: list, *, rank: int | list = 128, dtype: str = "q8_0",
                    recall: Optional[float | list] = 0.95, load: Optional[float | list] = None,
                    epochs: int = 4, held_out: float = 0.25, pin: int = 0,
                    n_threads: int = 1) -> Predictor:
    """A `kind` predictor fitted per layer on h (N, d) / acts (N, n_ff); thresholds set for recall
    (or load) per layer on the fitting tokens; recall/precision/load measured on the held-out
    last `held_out` share of tokens land in predictor.metrics. rank, recall and load may be
    per-layer lists. lowrank only: the `pin` slots of each layer with the largest calibration
    activation are always predicted (their bias is PIN_LOGIT): massive activations on the first
    token of a context are rare, so a low-rank logit misses them, and missing them is
    catastrophic (smollm2-135m: x300 perplexity at 50% load)."""
    if kind not in KINDS:
        raise TrainError(f"unknown predictor kind {kind!r}: expected one of {', '.join(KINDS)}")
    cfg = flash.config
    per = lambda v, i: v[i] if isinstance(v, (list, tuple)) else v       # noqa: E731
    layers, ths, metrics = [], [], {"recall": [], "precision": [], "load": []}
    for i in range(cfg.n_layers):
        h = np.asarray(h_by_layer[i], dtype=np.float32)                   # (N, d)
        mask = np.asarray(acts_by_layer[i]) >= act_thresholds[i]          # (N, n_ff)
        cut = max(1, int(len(h) * (1.0 - held_out)))
        w = ffn_weights(flash, i)
        gate, up = w.gate, w.up                                           # (n, d) each
        parts = layer_parts(kind, gate, up, h[:cut], mask[:cut], per(rank, i), dtype, epochs)
        if pin and kind == "lowrank":
            top = np.argsort(np.asarray(acts_by_layer[i])[:cut].max(axis=0))[-pin:]  # (pin,)
            parts["bias"][top] = PIN_LOGIT
        layers.append(parts)
        probe = Predictor(cfg, kind, [parts] * cfg.n_layers, [0.0] * cfg.n_layers, n_threads)
        s = probe.score(0, h)                                             # (N, n_ff)
        ld = per(load, i)                                                 # a load target wins
        th = threshold_for(s[:cut], mask[:cut], None if ld is not None else per(recall, i), ld)
        ths.append(th)
        for k, v in mask_metrics(s[cut:] >= th, mask[cut:]).items():
            metrics[k].append(v)
    pred = Predictor(cfg, kind, layers, ths, n_threads, metrics)
    return pred


def mask_metrics(pred: np.ndarray, mask: np.ndarray) -> dict:
    """recall, precision and load (share predicted) of pred vs mask, both (N, n_ff) bool."""
    tp = float(np.logical_and(pred, mask).sum())
    return {"recall": tp / max(float(mask.sum()), 1.0),
            "precision": tp / max(float(pred.sum()), 1.0),
            "load": float(pred.mean())}
