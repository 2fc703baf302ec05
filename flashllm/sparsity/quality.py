"""The sparsity a calibration keeps: the target asked for, lowered in steps while its thresholds
cost the model more than a bound of perplexity.

A target sparsity s drops, in each layer, the FFN terms whose |h| lies below the layer's
threshold (a share s of the calibration activations). What that costs depends on the model and
on the text: Qwen2.5-Coder-1.5B at s = 0.5 costs ~1% of perplexity against llama.cpp on held-out
code but ~5% on English prose, Gemma 3 270M ~6% (docs/PREDICTOR.md, "The sparsity a calibration
keeps"). So calibrate measures it on each text it calibrated on (a mix: code, prose, English,
public-domain literature; check_spans): the perplexity of the model with each candidate's
thresholds (over the bundles a budgeted run multiplies) against the dense model an unbudgeted
run computes (the source's own down rows where the folder has them; the caller measures:
sparsity/calibrate.py _quality), and keeps the largest target whose cost is within the bound on
every text. Against the dense model, the bound holds all a budgeted run pays, the bundles'
re-quantized down columns too (~0.7% on prose for the 1.5B): what a reader compares with
llama.cpp. A budgeted run reads the same bundles whatever the thresholds (they only skip
compute), so a lower target costs time, not bytes.

CHECK_VERSION stamps the rule a calibration was checked by; session/calibration.is_calibrated
calibrates a models.toml conversion checked by an older one again. 2 (issue 50): literature
in the mix, costs against the dense model; before (no stamp): code, prose and English, against
the bundles without thresholds.
"""
from __future__ import annotations

from typing import Callable, Sequence

QUALITY_STEP = 0.1       # targets tried: the asked one, then this much lower each time, to 0
QUALITY_TOKENS = 1024    # tokens the perplexities are measured on: one text's first ones ...
PART_TOKENS = 512        # ... or the first ones of each text of a mix
CHECK_VERSION = 2        # the rule below (module docstring)


def quality_steps(sparsity: float, criterion: str) -> list[float]:
    """The targets to try, the asked one first (none for a ReLU model, whose threshold is 0:
    its zeros cost nothing)."""
    if criterion == "relu" or sparsity <= 0:
        return []
    n = int(round(sparsity / QUALITY_STEP))
    lower = [round(sparsity - k * QUALITY_STEP, 6) for k in range(1, n + 1)]
    return [sparsity] + [t for t in lower if t > 1e-9] + [0.0]


def check_spans(parts: Sequence[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """(name, first token, tokens) of each text the checks measure, from the calibration
    tokens' parts ((name, tokens) in order): one text's first QUALITY_TOKENS, or each text's
    first PART_TOKENS of a mix."""
    each = QUALITY_TOKENS if len(parts) == 1 else PART_TOKENS
    spans, start = [], 0
    for name, n in parts:
        spans.append((name, start, min(n, each)))
        start += n
    return spans


def keep_quality(candidates: dict, ppl: Callable[[str, list], float], names: Sequence[str],
                 max_cost: float, log: Callable[[str], None]) -> dict:
    """{"target", "ppl_cost", "bound", "checked", "version"}: the largest target of candidates
    ({target: (thresholds [L], ...)}) whose thresholds cost at most max_cost of perplexity on
    every text of names, ppl(name, thresholds) against ppl(name, None) (the dense model); 0.0
    (no term dropped) when none does, its cost then measured on each text (the bundles' own,
    over the bound). checked: {name: cost} of the kept target; ppl_cost: the largest. A target
    stops at the first text over the bound, and the next starts with that text."""
    targets = sorted((t for t in candidates if t > 0), reverse=True)
    kept = {"target": 0.0, "ppl_cost": 0.0, "bound": max_cost,
            "checked": {name: 0.0 for name in names}, "version": CHECK_VERSION}
    if not targets:
        return kept
    base = {name: ppl(name, None) for name in names}
    order = list(names)
    for target in targets:
        costs = {}
        for name in order:
            costs[name] = ppl(name, list(candidates[target][0])) / base[name] - 1.0
            if costs[name] > max_cost:
                break
        log(f"sparsity {target:g}: perplexity " + ", ".join(
            f"{c:+.2%} on {name}" for name, c in costs.items()) + f" (bound {max_cost:.1%})")
        worst = max(costs, key=costs.__getitem__)
        if costs[worst] <= max_cost:
            return {**kept, "target": target, "ppl_cost": round(costs[worst], 5),
                    "checked": {name: round(costs[name], 5) for name in names}}
        order = [worst] + [name for name in order if name != worst]
    zeros = [0.0] * len(candidates[targets[0]][0])
    costs = {name: round(ppl(name, zeros) / base[name] - 1.0, 5) for name in names}
    log("sparsity 0: perplexity " + ", ".join(f"{c:+.2%} on {name}" for name, c in costs.items())
        + " (no target within the bound: the bundles' down columns cost this alone)")
    return {**kept, "ppl_cost": max(costs.values()), "checked": costs}
