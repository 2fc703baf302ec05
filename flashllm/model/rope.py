"""RoPE frequencies as data: a base (theta) and optional per-frequency divisors.

Pair j of a head (j < n_rot / 2) turns by pos * theta^(-2j / n_rot) / factor_j. The divisors are
llama.cpp's `rope_freqs` semantics (a GGUF tensor of n_rot / 2 values); every rope scaling flashllm
runs is one of them:

    default   no divisors
    linear    factor_j = factor for every j (position interpolation)
    llama3    factor_j = 1 for wavelengths below original_max_position_embeddings / high_freq_factor,
              factor beyond original_max_position_embeddings / low_freq_factor, and between them
              1 / ((1 - s) / factor + s) with s = (original / wavelength - low) / (high - low)
              (Llama 3.1; transformers' _compute_llama3_parameters, llama.cpp's convert_hf_to_gguf)

Any other scaling (yarn, longrope / su, dynamic) is refused in one line.
"""
from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from flashllm.errors import SourceError

ROPE_TYPES = ("default", "linear", "llama3")


def inv_freq(theta: float, n_rot: int, factors: tuple[float, ...] = ()) -> np.ndarray:
    """(n_rot / 2,) float64 angle per position of each pair: theta^(-2j / n_rot) / factor_j."""
    inv = float(theta) ** (-np.arange(n_rot // 2, dtype=np.float64) * 2.0 / n_rot)   # (n_rot/2,)
    return inv / np.asarray(factors, dtype=np.float64) if factors else inv


def llama3_factors(theta: float, n_rot: int, factor: float, low: float, high: float,
                   original: float) -> tuple[float, ...]:
    """The llama3 divisors (module docstring) of each of the n_rot / 2 frequencies."""
    out = []
    for f in inv_freq(theta, n_rot):
        wavelen = 2 * math.pi / f
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(float(factor))
        else:
            s = (original / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - s) / factor + s))
    return tuple(out)


def _num(spec: Mapping, key: str, where: str, default=None) -> float:
    value = spec.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise SourceError(f"{where}: rope scaling needs a positive {key!r}, got {value!r}")
    return float(value)


def scaling_factors(spec: Mapping, theta: float, n_rot: int, where: str) -> tuple[float, ...]:
    """The divisors of one HF rope spec ({"rope_type" | "type": ..., "factor": ...}); () for
    default RoPE; SourceError naming what is supported for any other type."""
    kind = spec.get("rope_type", spec.get("type", "default")) if spec else "default"
    if kind in (None, "default"):
        return ()
    if kind == "linear":
        return (_num(spec, "factor", where),) * (n_rot // 2)
    if kind == "llama3":
        return llama3_factors(theta, n_rot, _num(spec, "factor", where),
                              _num(spec, "low_freq_factor", where, 1.0),
                              _num(spec, "high_freq_factor", where, 4.0),
                              _num(spec, "original_max_position_embeddings", where, 8192))
    raise SourceError(f"{where}: rope scaling {kind!r} is unsupported "
                      f"(supported: {', '.join(ROPE_TYPES)})")


def hf_rope(cfg: Mapping, n_rot: int, where: str, layer_type: str = "full_attention",
            default_theta: float = 10000.0) -> tuple[float, tuple[float, ...]]:
    """(theta, divisors) of config.json for layers of `layer_type`: transformers 5's
    rope_parameters (flat, or per layer type as Gemma 3 has them) and transformers 4's
    rope_theta + rope_scaling; a scaling in either counts (two different ones are refused)."""
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get(layer_type), Mapping):
        params = params[layer_type]
    scaling = cfg.get("rope_scaling") or {}
    if scaling and not (scaling.get("rope_type") or scaling.get("type")):
        raise SourceError(f"{where}: rope_scaling {dict(scaling)!r} names no type")
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or default_theta)
    found = [f for f in (scaling_factors(params, theta, n_rot, where),
                         scaling_factors(scaling, theta, n_rot, where)) if f]
    if len(found) == 2 and found[0] != found[1]:
        raise SourceError(f"{where}: rope_parameters and rope_scaling name different scalings")
    return theta, found[0] if found else ()
