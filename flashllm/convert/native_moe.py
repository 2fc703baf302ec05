"""The native conversion of a mixture of experts' FFN (docs/FORMAT.md, "Expert rows"): every
expert is read whole (the router names it before a byte is read), so it needs no per-neuron
bundles. Each expert is stored as its source's rows — gate rows, up rows, then down rows (d_model
rows of n_ff values) — byte for byte in the GGUF's own types where the kernel has them:

- gate / up (routed and shared experts): copied when every layer stores them in one type the
  kernel has and d_model is whole blocks of it (Q4_0, Q4_K, Q8_0, ...); else re-quantized to
  q8_0 (f16 when d_model is not whole blocks of 32).
- down, per layer: copied when the layer's expert down tensor is a type the kernel has, with
  d_model and the experts' n_ff (and the shared expert's) whole blocks of it — Q4_K_M's Q6_K
  layers stay Q6_K, its Q4_K layers Q4_K, a Q4_0 file's Q4_0; else re-quantized (its rows) to
  q8_0 (f16 when those are not whole blocks of 32). A shared expert whose down type differs from
  the layer's is re-quantized to the layer's.

Nothing is re-quantized across the source's blocks (down rows are the source's rows, not
columns), so an expert takes the GGUF's bytes — a Q4_0 expert 3·1152 bytes a neuron at d_model
2048, against 2·1152 + 2176 with q8_0 down columns — and keeps its values exactly.
"""
from __future__ import annotations

from flashllm.convert.native import (FALLBACK, NativePlan, RmsError, check_source, requantize,
                                     requantized_origin)
from flashllm.format.layout import fits
from flashllm.model.tensor import FROM_GGML, QTensor


def _fallback(*lengths: int) -> str:
    """q8_0 when every length is whole blocks of 32, else f16."""
    return FALLBACK if all(fits(FALLBACK, n) for n in lengths) else "f16"


def plan_experts(source, ffn: list[dict[str, dict[str, str]]]) -> NativePlan:
    """The expert FFN dtypes of a native conversion of source (ffn: per layer {"exps"[, "shexp"]:
    {part: tensor name}}): gate / up copied or q8_0, one down dtype per layer."""
    check_source(source)
    cfg = source.config
    d, ns = cfg.d_model, [n for n in (cfg.n_ff, cfg.n_ff_shared) if n]
    types = {source.stored_type(n) for groups in ffn for g in groups.values()
             for p, n in g.items() if p != "down"}
    dt = FROM_GGML.get(types.pop()) if len(types) == 1 else None
    copied = dt is not None and fits(dt, d)
    downs = []
    for groups in ffn:
        kept = FROM_GGML.get(source.stored_type(groups["exps"]["down"]))
        ok = kept is not None and all(fits(kept, n) for n in (d, *ns))
        downs.append(kept if ok else _fallback(d, *ns))
    return NativePlan(dt if copied else _fallback(d), copied, tuple(downs))


def write_expert_layer(w, source, layer: int, groups: dict[str, dict[str, str]],
                       p: NativePlan) -> None:
    """Write one MoE layer: each routed expert's rows, then the shared expert's, in the plan's
    dtypes (one expert in memory at a time), with the layer's origin (per part; the shared
    expert's as shexp_gate, shexp_up, shexp_down)."""
    cfg, origin, errs = source.config, {}, {}
    want = {"gate": p.ffn_dtype, "up": p.ffn_dtype, "down": p.down_dtypes[layer]}
    for group, names in groups.items():
        for part, name in names.items():
            key, stored = (part if group == "exps" else f"shexp_{part}"), source.stored_type(name)
            if FROM_GGML.get(stored) == want[part] and (part == "down" or p.gate_up_copied):
                origin[key] = {"from": stored, "how": "copied"}
            else:
                origin[key], errs[key] = requantized_origin(stored, want[part]), RmsError()

    def part(group: str, key: str, name: str, dtype: str, rows: int, cols: int, e=None) -> QTensor:
        if origin[key]["how"] == "copied":
            raw = source.load_blocks(name) if e is None else source.load_expert_blocks(name, e)
            return QTensor(raw, dtype, rows, cols)
        x = source.load(name) if e is None else source.load_expert(name, e)  # (rows, cols) f32
        return QTensor(requantize(x, dtype, errs[key]), dtype, rows, cols)

    def expert(group: str, n: int, e=None) -> list[QTensor]:
        names, pre = groups[group], "" if group == "exps" else "shexp_"
        shapes = {"gate": (n, cfg.d_model), "up": (n, cfg.d_model), "down": (cfg.d_model, n)}
        return [part(group, pre + q, names[q], want[q], *shapes[q], e) for q in ("gate", "up", "down")]

    last = cfg.n_experts - 1 if "shexp" not in groups else None
    for e in range(cfg.n_experts):
        parts = expert("exps", cfg.n_ff, e)
        if e == last:
            _close(origin, errs)
        w.add_expert_rows(layer, *parts, origin=origin)
    if "shexp" in groups:
        parts = expert("shexp", cfg.n_ff_shared)
        _close(origin, errs)
        w.add_expert_rows(layer, *parts, origin=origin)


def _close(origin: dict, errs: dict) -> None:
    """Fill in the re-quantized parts' errors once every expert's part is made."""
    for key, err in errs.items():
        origin[key]["rel_rms"] = round(err.value, 7)
