"""How near-uniform the MoE bench's routing is: per layer, over decode tokens sampled as
scripts/bench/moe.py samples them (its prompt, temperature 1, seed 1), the share of routings the
c most-routed experts take (what a cache of c experts that knew them would serve) against
c / n_experts (uniform routing), and how many distinct experts were routed.

Run:  python -m scripts.bench.moe_routing [--model build/moe/olmoe-q4_0] [--n-gen 32] [--cached 28]

The experts stream from flash (runtime/expert_ffn.py, `--cached` experts per layer), so the
model need not fit in DRAM; only the routers' choices are recorded.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from scripts.bench.moe import BUILD, PROMPT


def record_routing(model: Path, n_gen: int, cached: int) -> np.ndarray:
    """Routed experts (n_gen - 1, n_layers, k) int32 of the decode passes of one bench run."""
    from flashllm.ffi.reader import Reader
    from flashllm.format.reader import open_flash
    from flashllm.generation.generate import generate
    from flashllm.generation.sampler import Sampler, SamplerParams
    from flashllm.generation.tokenizer import Tokenizer
    from flashllm.format.manifest import read_manifest
    from flashllm.runtime.budget import parse_budget, plan_budget
    from flashllm.runtime.expert_ffn import ExpertFlashFfn
    from flashllm.runtime.model import Model
    flash = open_flash(model)
    cfg = flash.config
    plan = dataclasses.replace(plan_budget(read_manifest(model), parse_budget(str(1 << 40)), 128, process=0),
                               capacity=cached * cfg.n_ff)
    ffn = ExpertFlashFfn(flash, plan, Reader(flash.ffn.file, n_threads=2), n_threads=2)
    seen: list = []                                     # per decode pass and layer: (k,) experts
    route = ffn.routers.route

    def recording(layer: int, h: np.ndarray):
        experts, weights = route(layer, h)              # (T, k), (T, k)
        if len(h) == 1:
            seen.append(experts[0].copy())
        return experts, weights

    ffn.routers.route = recording
    net = Model(flash, n_threads=2, n_ctx=128, ffn=ffn)
    ids = Tokenizer.from_flash(flash).encode(PROMPT)
    generate(net, Sampler(SamplerParams(temp=1.0, seed=1)), ids, n_gen)
    ffn.close()
    return np.array(seen, dtype=np.int32).reshape(-1, cfg.n_layers, cfg.n_experts_used)


def top_and_distinct(routed: np.ndarray, n_experts: int, cached: int) -> tuple:
    """Per layer of routed (tokens, n_layers, k): (the top-`cached` experts' share of the
    routings (n_layers,), the distinct experts routed (n_layers,))."""
    counts = np.stack([np.bincount(routed[:, i].ravel(), minlength=n_experts)   # (layers, E)
                       for i in range(routed.shape[1])])
    top = np.sort(counts, axis=1)[:, ::-1][:, :cached].sum(axis=1) / counts.sum(axis=1)  # (layers,)
    return top, (counts > 0).sum(axis=1)


def skew(routed: np.ndarray, n_experts: int, cached: int, trials: int = 200) -> dict:
    """top_and_distinct of routed (tokens, n_layers, k) and their means, against the same
    figures of uniform routing over as many tokens (simulated: `trials` draws, seed 0)."""
    top, distinct = top_and_distinct(routed, n_experts, cached)
    rng, (n, layers, k) = np.random.default_rng(0), routed.shape
    uniform = np.argsort(rng.random((trials, n, layers, n_experts)), axis=3)[..., :k]
    u = [top_and_distinct(r, n_experts, cached) for r in uniform]    # each: (layers,), (layers,)
    return {"tokens": int(n), "cached": cached, "top_share_mean": float(top.mean()),
            "uniform_top_share_mean": float(np.mean([t.mean() for t, _ in u])),
            "distinct_mean": float(distinct.mean()),
            "uniform_distinct_mean": float(np.mean([d.mean() for _, d in u])),
            "top_share_per_layer": top.round(3).tolist(), "distinct_per_layer": distinct.tolist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=BUILD / "olmoe-q4_0")
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--cached", type=int, default=28, help="experts a layer's cache holds")
    args = ap.parse_args()
    routed = record_routing(args.model, args.n_gen, args.cached)
    n_experts = json.loads((args.model / "manifest.json").read_text())["config"]["n_experts"]
    print(json.dumps(skew(routed, n_experts, args.cached)))


if __name__ == "__main__":
    main()
