"""The parts of a run from its plan (runtime/plan.py choose_plan): the FFN strategy — dense
(default), sparse flash under a DRAM budget, or the naive flash baseline — the dense weights, a
sparse output head, and the read-ahead schedule they share.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from flashllm.runtime.budget import BudgetError, BudgetPlan
from flashllm.format.layout import SKETCH
from flashllm.runtime.plan import READER_STAGE, READER_THREADS, FlashOptions
from flashllm.runtime.sparse_head import SparseHead


def default_window(manifest: dict) -> int:
    """4 for ReLU-like (non-GLU) models, 2 for GLU models (the paper's OPT/Falcon vs Llama 2)."""
    return 2 if manifest["config"]["glu"] else 4


def make_weights(flash, plan: Optional[BudgetPlan], n_threads: int):
    """The dense weights for Model(weights=...): None (all resident) unless the plan streams some.
    The resident matrices are packed as a run without a budget packs them (the plan counts the
    packed bytes: budget.dense_groups): the same kernels, whose products do not depend on how
    many tokens a pass holds, so a verifying pass gives each token what decoding it alone does."""
    if plan is None or not plan.streamed:
        return None
    from flashllm.runtime.weights import DenseWeights
    from flashllm.ffi.reader import Reader
    reader = Reader(flash.dense_file, n_threads=READER_THREADS, stage_bytes=READER_STAGE)
    return DenseWeights(flash, n_threads, plan.streamed, reader, pack=True)


def make_head(flash, plan: Optional[BudgetPlan], weights, need, n_threads: int):
    """The sparse output head for Model(head=...) when the plan streams it sparsely, else None."""
    if plan is None or not plan.sparse_head or weights is None or need is None:
        return None
    return SparseHead(flash, weights, need, n_threads, softcap=flash.config.final_softcap)


def stream_dense(flash, ffn, weights, sparse_head: bool = False) -> None:
    """When the FFN reads the same bundles every pass (its read-ahead schedule), the streamed
    attention and output head join that schedule: one queue keeps the device busy (else the
    dense weights' own reader reads them while the FFN's ring waits). With a sparse head the
    schedule carries the head's sketch instead (its candidate rows are read when known)."""
    if ffn is None or weights is None or getattr(ffn, "schedule", None) is None:
        return
    from flashllm.ffi.reader import Reader
    layers = weights.streamed_layers()
    if weights.head is not None and not layers:
        return
    reader = Reader(flash.dense_file, n_threads=ffn.reader.n_threads, stage_bytes=READER_STAGE)
    attention = {i: (reader, *weights.attention_extents(i)) for i in layers}
    extents = [] if weights.head is not None else \
        weights.head_extents(ffn.schedule.buffer_bytes, SKETCH if sparse_head else "")
    if ffn.stream_dense(attention, (reader, extents)):
        weights.layer_source = ffn.attention_bytes
        if sparse_head:                    # the schedule carries the sketch in the head's place
            weights.sketch_source = ffn.head_chunks
        else:
            weights.head_source = ffn.head_chunks
    else:
        reader.close()


def make_ffn(flash, opts: FlashOptions, plan: Optional[BudgetPlan], n_threads: int,
             cache_dir: Path, log=lambda m: None):
    """The FFN strategy for Model(ffn=...): None (dense), an ExpertFlashFfn (a mixture of
    experts) or a SparseFlashFfn."""
    if not opts.flash:
        return None
    if flash.config.n_experts:
        return make_expert_ffn(flash, opts, plan, n_threads, cache_dir, log)
    if holds_ffn_rows(flash, opts, plan):
        from flashllm.runtime.ffn import DenseFfn
        log("the budget holds the whole FFN: it runs as with no budget (the GGUF's own rows, "
            "every neuron, nothing read)")
        return DenseFfn(flash, n_threads, summary=plan.summary())
    from flashllm.storage.costmodel import CostModel, bundle_requests
    from flashllm.ffi.reader import Reader
    from flashllm.sparsity.predictor import AllSlots, load_predictor
    from flashllm.runtime.sparse_ffn import SparseFlashFfn
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
    return SparseFlashFfn(flash, predictor or AllSlots(f.n_ff), plan, reader, n_threads=n_threads,
                          window=window, naive=opts.naive, cost=cost, check=opts.check)


def holds_ffn_rows(flash, opts: FlashOptions, plan: Optional[BudgetPlan]) -> bool:
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


def make_expert_ffn(flash, opts: FlashOptions, plan: BudgetPlan, n_threads: int, cache_dir: Path,
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
