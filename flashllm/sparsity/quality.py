"""The sparsity a calibration keeps: the target asked for, lowered in steps while its thresholds
cost the model more than a bound of perplexity.

A target sparsity s drops, in each layer, the FFN terms whose |h| lies below the layer's
threshold (a share s of the calibration activations). What that costs depends on the model:
Qwen2.5-Coder-1.5B at s = 0.5 costs ~1% of perplexity against llama.cpp on held-out text, Gemma
3 270M ~6%, SmolLM2-135M ~3% (docs/PREDICTOR.md, "The sparsity a calibration keeps"). So
calibrate measures it: the perplexity of the model with each candidate's thresholds against the
same FFN with none (the bundles a budgeted run multiplies; the caller measures: session/calibration.py
bundle_ppl) on the calibration tokens' first QUALITY_TOKENS, and keeps the largest target within
the bound. A budgeted run reads the same bundles whatever the thresholds (they only skip
compute), so a lower target costs time, not bytes.
"""
from __future__ import annotations

from typing import Callable

QUALITY_STEP = 0.1       # targets tried: the asked one, then this much lower each time, to 0
QUALITY_TOKENS = 1024    # calibration tokens the perplexities are measured on (chunks of n_ctx)


def quality_steps(sparsity: float, criterion: str) -> list[float]:
    """The targets to try, the asked one first (none for a ReLU model, whose threshold is 0:
    its zeros cost nothing)."""
    if criterion == "relu" or sparsity <= 0:
        return []
    n = int(round(sparsity / QUALITY_STEP))
    lower = [round(sparsity - k * QUALITY_STEP, 6) for k in range(1, n + 1)]
    return [sparsity] + [t for t in lower if t > 1e-9] + [0.0]


def keep_quality(candidates: dict, ppl: Callable[[list], float], max_cost: float,
                 log: Callable[[str], None]) -> dict:
    """{"target", "ppl_cost", "bound"}: the largest target of candidates ({target: (thresholds
    [L], ...)}) whose thresholds cost at most max_cost of perplexity, ppl(thresholds) against
    ppl(zeros); 0.0 (no term dropped) when none does."""
    targets = sorted((t for t in candidates if t > 0), reverse=True)
    kept = {"target": 0.0, "ppl_cost": 0.0, "bound": max_cost}
    if not targets:
        return kept
    base = ppl([0.0] * len(candidates[targets[0]][0]))
    for target in targets:
        cost = ppl(list(candidates[target][0])) / base - 1.0
        log(f"sparsity {target:g}: perplexity {cost:+.2%} on the calibration text "
            f"(bound {max_cost:.0%})")
        if cost <= max_cost:
            return {**kept, "target": target, "ppl_cost": round(cost, 5)}
    return kept
