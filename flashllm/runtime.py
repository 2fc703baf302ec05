"""The FFN strategy of `flashllm run` from its options: dense (default), sparse flash under a
DRAM budget, or the naive flash baseline. The budget is planned from the manifest alone, so a
budget that cannot work is refused before anything is loaded.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from .budget import BudgetError, BudgetPlan, mib, model_bytes, plan_budget, read_manifest
from .profile import KiB

READER_STAGE = 256 * KiB        # per reader thread: the largest single read (64-256 KiB is best)


@dataclass(frozen=True)
class FlashOptions:
    """The flash-related options of `run`."""

    dram_budget: Optional[str] = None     # "1.5GiB", "560MiB", "50%"; None: no budget
    window: Optional[int] = None          # tokens whose neurons stay cached; None: by activation
    naive: bool = False                   # read every bundle every token (the paper's baseline)
    dense: bool = False                   # every bundle in DRAM (today's default)
    check: bool = False                   # also compute the exact mask: predictor recall

    @property
    def flash(self) -> bool:
        """True when the FFN streams from flash."""
        return not self.dense and (self.dram_budget is not None or self.naive)


def default_window(manifest: dict) -> int:
    """4 for ReLU-like (non-GLU) models, 2 for GLU models (the paper's OPT/Falcon vs Llama 2)."""
    return 2 if manifest["config"]["glu"] else 4


def plan_run(path: Path, opts: FlashOptions, n_ctx: int, process: int) -> Optional[BudgetPlan]:
    """The budget plan of a run (None for dense without a budget); BudgetError when it cannot work."""
    if opts.dense and opts.naive:
        raise BudgetError("give --dense or --naive, not both")
    if opts.window is not None and opts.window < 1:
        raise BudgetError(f"--window {opts.window} must be at least 1")
    if opts.dram_budget is None and not opts.naive:
        return None
    man = read_manifest(path)
    text = opts.dram_budget or "100%"
    predictor = int((man.get("predictor") or {}).get("nbytes") or 0) if not opts.naive else 0
    stage = 16 * READER_STAGE
    if opts.dram_budget is None:   # --naive alone: no limit, the whole model's worth
        text = f"{model_bytes(man) + (1 << 30)}"
    plan = plan_budget(man, text, n_ctx, process, predictor=predictor, reader_stage=stage,
                       naive=opts.naive)
    if opts.dense and plan.capacity < plan.n_ff:
        need = plan.total - plan.cache_bytes + plan.n_layers * plan.n_ff * plan.stride
        raise BudgetError(f"--dense needs {mib(need)} (every FFN bundle in DRAM), --dram-budget "
                          f"{opts.dram_budget} gives {mib(plan.budget, up=False)}: drop --dense to stream "
                          f"the FFN from flash")
    return plan


def make_weights(flash, plan: Optional[BudgetPlan], n_threads: int):
    """The dense weights for Model(weights=...): None (all resident) unless the plan streams some."""
    if plan is None or not plan.streamed:
        return None
    from .dense_stream import DenseWeights
    from .ioreader import Reader
    reader = Reader(flash.dense_file, n_threads=2, stage_bytes=READER_STAGE)
    return DenseWeights(flash, n_threads, plan.streamed, reader)


def make_ffn(flash, opts: FlashOptions, plan: Optional[BudgetPlan], n_threads: int,
             cache_dir: Path, log=lambda m: None):
    """The FFN strategy for Model(ffn=...): None (dense) or a SparseFlashFfn."""
    if not opts.flash:
        return None
    from .costmodel import CostModel, bundle_requests
    from .ioreader import Reader
    from .sparse_ffn import AllSlots, SparseFlashFfn
    cost = CostModel.for_path(cache_dir, flash.ffn.file)
    if cost.hint:
        log(cost.hint)
    f = flash.ffn
    sample = np.random.default_rng(0).choice(f.n_ff, size=max(1, f.n_ff // 3), replace=False)
    offs, lens = bundle_requests(f.layer_offsets[0], f.stride, sample)   # (k,) (k,)
    threads = cost.plan(offs, lens).threads
    predictor = None if opts.naive else _predictor(flash, n_threads, log)
    reader = Reader(f.file, n_threads=threads, stage_bytes=READER_STAGE)
    window = opts.window or default_window(flash.manifest)
    for note in plan.notes:
        log(note)
    return SparseFlashFfn(flash, predictor or AllSlots(f.n_ff), plan, reader, n_threads=n_threads,
                          window=window, naive=opts.naive, cost=cost, check=opts.check)


def _predictor(flash, n_threads: int, log):
    """The manifest's predictor, or None (every neuron then counts as active)."""
    from .predictor import load_predictor
    pred = load_predictor(flash, n_threads)
    if pred is None:
        log("no predictor in the model (run calibrate): every FFN neuron is read as active")
    return pred
