"""The FFN strategy of `flashllm run` from its options: dense (default), sparse flash under a
DRAM budget, or the naive flash baseline. The budget is planned from the manifest alone, so a
budget that cannot work is refused before anything is loaded.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional

import numpy as np

from flashllm.format.layout import SKETCH
from flashllm.format.reader import FlashModel
from flashllm.runtime.budget import BudgetPlan
from flashllm.runtime.budget_given import BudgetError
from flashllm.runtime.interfaces import FfnStrategy
from flashllm.runtime.plan import READER_STAGE, READER_THREADS, FlashOptions
from flashllm.runtime.sparse_head import HeadNeed, SparseHead
from flashllm.runtime.weights import DenseWeights
from flashllm.sparsity.predictor import NeuronPredictor

if TYPE_CHECKING:     # loaded when a run builds them, not before its plan (which counts the process)
    from flashllm.ffi.reader import Reader
    from flashllm.runtime.sparse_ffn import SparseFlashFfn
    from flashllm.runtime.stream import PassStream


def default_window(manifest: dict) -> int:
    """4 for ReLU-like (non-GLU) models, 2 for GLU models (the paper's OPT/Falcon vs Llama 2)."""
    return 2 if manifest["config"]["glu"] else 4


def make_parts(flash: FlashModel, opts: FlashOptions, plan: Optional[BudgetPlan],
               need: Optional[HeadNeed], n_threads: int, cache_dir: Path, log=lambda m: None
               ) -> tuple[Optional[FfnStrategy], Optional[DenseWeights], Optional[SparseHead]]:
    """The run's FFN strategy, dense weights and sparse head for Model(ffn=, weights=, head=):
    make_ffn, make_weights, make_head, the read stream of a static pass built with the FFN and
    handed to the other two (runtime/stream.py: one queue keeps the device busy)."""
    sketch = plan is not None and plan.sparse_head and bool(plan.streamed) and need is not None
    ffn, stream = make_ffn(flash, opts, plan, n_threads, cache_dir, log, SKETCH if sketch else "")
    weights = make_weights(flash, plan, n_threads, stream)
    return ffn, weights, make_head(flash, plan, weights, need, n_threads, stream)


def make_weights(flash: FlashModel, plan: Optional[BudgetPlan], n_threads: int,
                 stream: Optional[PassStream] = None) -> Optional[DenseWeights]:
    """The dense weights for Model(weights=...): None (all resident) unless the plan streams some
    (through its own reader, and the read stream's entries where it carries them).
    The resident matrices are packed as a run without a budget packs them (the plan counts the
    packed bytes: budget.dense_groups): the same kernels, whose products do not depend on how
    many tokens a pass holds, so a verifying pass gives each token what decoding it alone does."""
    if plan is None or not plan.streamed:
        return None
    from flashllm.ffi.reader import Reader
    reader = Reader(flash.dense_file, n_threads=READER_THREADS, stage_bytes=READER_STAGE)
    return DenseWeights(flash, n_threads, plan.streamed, reader, pack=True, stream=stream)


def make_head(flash: FlashModel, plan: Optional[BudgetPlan], weights: Optional[DenseWeights],
              need: Optional[HeadNeed], n_threads: int,
              stream: Optional[PassStream] = None) -> Optional[SparseHead]:
    """The sparse output head for Model(head=...) when the plan streams it sparsely, else None;
    its sketch comes from the read stream when that carries it."""
    if plan is None or not plan.sparse_head or weights is None or need is None:
        return None
    return SparseHead(flash, weights, need, n_threads, softcap=flash.config.final_softcap,
                      stream=stream)


def make_ffn(flash: FlashModel, opts: FlashOptions, plan: Optional[BudgetPlan], n_threads: int,
             cache_dir: Path, log=lambda m: None, head: str = ""
             ) -> tuple[Optional[FfnStrategy], Optional[PassStream]]:
    """(the FFN strategy for Model(ffn=...): None (dense), an ExpertFlashFfn (a mixture of
    experts), a DenseFfn (holds_ffn_rows) or a SparseFlashFfn; the read stream its static
    passes take from, None without one). head: the matrix the stream carries in the output
    head's place (its sketch: make_parts)."""
    if not opts.flash:
        return None, None
    if flash.config.n_experts:
        return make_expert_ffn(flash, opts, plan, n_threads, cache_dir, log), None
    if holds_ffn_rows(flash, opts, plan):
        from flashllm.runtime.ffn import DenseFfn
        log("the budget holds the whole FFN: it runs as with no budget (the GGUF's own rows, "
            "every neuron, nothing read)")
        return DenseFfn(flash, n_threads, summary=plan.summary()), None
    from flashllm.storage.costmodel import CostModel, bundle_requests
    from flashllm.ffi.reader import Reader
    from flashllm.sparsity.predictor import AllSlots, load_predictor
    cost = CostModel.for_path(cache_dir, flash.ffn.file)
    if cost.hint:
        log(cost.hint)
    f = flash.ffn
    sample = np.random.default_rng(0).choice(f.n_ff, size=max(1, f.n_ff // 3), replace=False)
    offs, lens = bundle_requests(f.layer_offsets[0], f.strides[0], sample)   # (k,) (k,)
    threads = cost.plan(offs, lens).threads
    predictor = load_predictor(flash, n_threads) if plan.predictor else None
    reader = Reader(f.file, n_threads=threads, stage_bytes=READER_STAGE)
    window = opts.window or default_window(flash.manifest)
    for note in plan.notes:
        log(note)
    ffn = make_sparse_ffn(flash, predictor or AllSlots(f.n_ff), plan, reader, n_threads, window,
                          naive=opts.naive, cost=cost, check=opts.check, head=head)
    return ffn, ffn.stream


def make_sparse_ffn(flash: FlashModel, predictor: NeuronPredictor, plan: BudgetPlan,
                    reader: Reader, n_threads: int, window: int, naive: bool = False,
                    cost=None, check: bool = False, exact: bool = False,
                    streamed: Optional[Iterable[str]] = None, head: str = "") -> SparseFlashFfn:
    """A SparseFlashFfn over reader, its read stream built first when its passes are static
    (runtime/stream.py pass_stream: the FFN chunks past the pinned rows, and the dense matrices
    `streamed` (default: the plan's) that fit its buffers; head as make_ffn's); ffn.stream."""
    from flashllm.runtime.sparse_ffn import SparseFlashFfn, pinned_rows, static_slots
    from flashllm.runtime.stream import pass_stream
    k = static_slots(predictor, naive, flash.ffn.n_ff)
    stream = None if k is None else pass_stream(
        flash, reader, plan.staging_rows, plan.streamed if streamed is None else streamed, k,
        0 if naive else pinned_rows(plan, k), head, READER_STAGE)
    return SparseFlashFfn(flash, predictor, plan, reader, n_threads=n_threads, window=window,
                          naive=naive, cost=cost, check=check, exact=exact, stream=stream)


def holds_ffn_rows(flash: FlashModel, opts: FlashOptions, plan: Optional[BudgetPlan]) -> bool:
    """True when the plan caches every neuron of every layer and the FFN's row form (runtime/
    ffn.py DenseFfn: gate/up rows, the GGUF's down rows; what a run with no budget multiplies)
    fits the same DRAM (the caches' and the staging buffers' bytes, less one layer's bundles
    for its load): the same FFN with nothing to read is computed the fast way, exactly (a
    calibration's thresholds only save reads). Not with --naive, --check, a predictor or a
    self-draft (it drafts from the neuron caches)."""
    if plan is None or opts.naive or opts.check or opts.draft_rows or plan.predictor \
            or flash.down_rows is None or plan.capacity < plan.n_ff:
        return False
    from flashllm.ffi import kernel
    f = flash.ffn
    k = 2 if f.glu else 1
    gate_up = [kernel.packed_nbytes(f.dtype, k * f.n_ff, f.d_model) or k * f.n_ff * f.part_bytes
               for _ in f.strides]
    down = [kernel.packed_nbytes(t["dtype"], f.d_model, f.n_ff) or int(t["nbytes"])
            for t in flash.down_rows]
    need = sum(gate_up) + sum(down)
    room = plan.budget - plan.total + plan.cache_bytes + plan.staging_rows * plan.stride
    # a layer's load: its bundles, its gate/up rows copied out and packed; the dense weights
    # load after the FFN (make_ffn before make_weights / Model), so their DRAM is still free
    load = max(f.strides) * f.n_ff + 2 * max(gate_up)
    return need <= room and load <= room - need + plan.resident.get("dense weights", 0)


def make_expert_ffn(flash: FlashModel, opts: FlashOptions, plan: BudgetPlan, n_threads: int, cache_dir: Path,
                    log=lambda m: None):
    """The expert-streaming FFN of a mixture of experts (runtime/expert_ffn.py): the router picks
    the experts, so no predictor, window or calibration applies; --naive reads every routed
    expert every pass (no cache, no read-ahead)."""
    from flashllm.storage.costmodel import CostModel
    from flashllm.ffi.reader import Reader
    from flashllm.runtime.expert_ffn import ExpertFlashFfn
    if opts.check or opts.predictor == "on" or opts.window is not None:
        raise BudgetError("--check, --predictor on and --window are for a dense FFN's neurons; "
                          "a mixture of experts is routed exactly")
    cost = CostModel.for_path(cache_dir, flash.ffn.file)
    if cost.hint:
        log(cost.hint)
    f = flash.ffn
    expert = f.stride * flash.config.n_ff
    threads = cost.plan(np.array([f.layer_offsets[0]]), np.array([expert])).threads
    reader = Reader(f.file, n_threads=threads, stage_bytes=READER_STAGE)
    return ExpertFlashFfn(flash, plan, reader, n_threads=n_threads, naive=opts.naive)
