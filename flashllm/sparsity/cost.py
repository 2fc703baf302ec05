"""What a calibration costs before it runs: its time (said up front) and its memory (checked
against a DRAM budget), from the model's shape and the calibration's tokens.

Time: the dense pass multiplies every weight for each calibration token (the C kernel) and
scores every FFN neuron in f32 (numpy); each target checked runs the model over the bundles
on each text's check tokens (sparsity/quality.check_spans); the predictor trains one layer at a
time. The rates are measured on a
2-core x86 machine (Qwen2.5-Coder-1.5B and SmolLM2-135M, docs/PREDICTOR.md, "Calibrating in
bounded memory"): an estimate, within a factor of about 1.5.

Memory: one layer's scores (N, n_ff) f32, the hidden states and FFN inputs of all tokens (N,
d_model) f32 each, one layer's FFN read twice (its rows and its bundles), the process itself;
the predictor's training holds the predictor itself on top of one layer's arrays
(training_bytes).
"""
from __future__ import annotations

from typing import Optional

from flashllm.units import MiB

KERNEL_GFLOPS = 40.0       # the dense pass's and the checks' matmuls (int8 activations, 2 threads)
SCORE_GFLOPS = 25.0        # numpy f32 scores
TRAIN_SECONDS = 0.25       # a gate_up predictor's layer per 1000 tokens per million neuron-dims
PROCESS_BYTES = 90 * MiB   # Python, numpy, the kernel, the manifest, the sparse head's check
ALLOWANCE = 1.25           # the allocator's and temporaries' share over the arrays counted


def layer_weights(cfg) -> int:
    """Weights a token multiplies in one layer (attention and FFN)."""
    attn = cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    return attn + (3 if cfg.glu else 2) * cfg.n_ff * cfg.d_model


def seconds(cfg, n_tokens: int, check_tokens: int, checks: int, predictor: bool) -> float:
    """Rough seconds of a calibration with `checks` perplexity checks (2 when the asked target
    holds: the FFN without thresholds, then with) on check_tokens each (all its texts'), and a
    predictor."""
    matmul = 2 * layer_weights(cfg) * cfg.n_layers                   # flops a token
    score = 2 * (2 if cfg.glu else 1) * cfg.n_ff * cfg.d_model * cfg.n_layers
    t = (n_tokens + checks * check_tokens) * matmul / (KERNEL_GFLOPS * 1e9)
    t += n_tokens * score / (SCORE_GFLOPS * 1e9)
    if predictor:
        t += TRAIN_SECONDS * cfg.n_layers * n_tokens / 1e3 * cfg.n_ff * cfg.d_model / 1e6
    return t


def peak_bytes(flash, n_tokens: int) -> int:
    """Rough peak DRAM of calibrating flash on n_tokens (module doc)."""
    cfg, f = flash.config, flash.ffn
    ffn = max(f.strides) * f.n_ff
    arrays = 4 * n_tokens * (cfg.n_ff + 2 * cfg.d_model) + 2 * ffn
    return int(PROCESS_BYTES + ALLOWANCE * arrays)


def training_bytes(cfg, kind: str, n_tokens: int) -> int:
    """Rough peak DRAM of training a `kind` predictor on n_tokens (calibrate's last stage): the
    predictor made so far, one layer's FFN weights in f32 (gate, up, down) and four (N, n_ff)
    f32 arrays of it (scores, the mask, the trial predictor's scores, their temporaries), the
    process. Qwen2.5-Coder-1.5B, gate_up, 2048 tokens: 1,102 MB counted, 1,135 MB RSS measured."""
    arrays = 4 * 3 * cfg.n_ff * cfg.d_model + 4 * 4 * n_tokens * cfg.n_ff
    return int(PROCESS_BYTES + predictor_bytes(cfg, kind) + ALLOWANCE * arrays)


def predictor_bytes(cfg, kind: str) -> int:
    """DRAM a trained predictor of kind holds (what a budgeted run would have to keep)."""
    if kind in ("gate", "gate_up"):
        per = (1 if kind == "gate" else 2) * cfg.n_ff * cfg.d_model * 18 // 32   # q4_0
        return per * cfg.n_layers
    return 128 * (cfg.d_model + cfg.n_ff) * cfg.n_layers + 4 * cfg.n_ff * cfg.n_layers


def disk_bytes(flash, n_tokens: int, predictor: Optional[str], reorder: bool) -> int:
    """Bytes a calibration writes into flash's folder (and an unnamed file beside it) while the
    old files stay until the manifest's switch (sparsity/reorder.py): the hot-first FFN file and
    its order (reorder), the frequencies, the predictor and the FFN inputs it trains on."""
    cfg = flash.config
    slots = 4 * cfg.n_layers * cfg.n_ff                          # an (n_layers, n_ff) table
    ffn = flash.manifest["ffn"]["nbytes"] + slots if reorder else 0
    pred = predictor_bytes(cfg, predictor) + 4 * n_tokens * cfg.d_model * cfg.n_layers \
        if predictor else 0
    return ffn + slots + pred
