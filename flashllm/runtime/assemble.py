"""The FFN strategy of `flashllm run` from its options: dense (default), sparse flash under a
DRAM budget, or the naive flash baseline. The budget is planned from the manifest alone, so a
budget that cannot work is refused before anything is loaded.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional

import numpy as np

from flashllm.format.layout import SKETCH
from flashllm.format.reader import FlashModel
from flashllm.runtime.budget import (BudgetError, BudgetPlan, head_name, model_bytes, plan_budget,
                                     read_manifest)
from flashllm.runtime.interfaces import FfnStrategy
from flashllm.runtime.resident import carries, carry_bytes, head_rows_bytes, head_rows_fit
from flashllm.runtime.sparse_head import HeadNeed, SparseHead, sketch_bytes
from flashllm.runtime.weights import DenseWeights
from flashllm.sparsity.predictor import NeuronPredictor
from flashllm.units import KiB, format_size

if TYPE_CHECKING:     # loaded when a run builds them, not before its plan (which counts the process)
    from flashllm.ffi.reader import Reader
    from flashllm.runtime.sparse_ffn import SparseFlashFfn
    from flashllm.runtime.stream import PassStream

READER_STAGE = 256 * KiB        # per reader thread: the largest single read (64-256 KiB is best)
READER_THREADS = 16             # staging buffers the budget reserves for the reader pool
ROWS_STAGING = READER_THREADS * READER_STAGE   # the dense weights' reader's staging, which a
                                # sparse head's candidate rows fill (make_dense: its reader)
PREDICTOR_MODES = ("auto", "on", "off")
DRAFT_KINDS = ("lookup", "self")  # --draft-kind: prompt lookup, the resident model
DRAFT_HEAD_ROWS = 16384         # a self draft's output head rows when the head streams ...
DRAFT_HEAD_SHARE = 0.06         # ... as far as they take this share of the caches' DRAM, ...
DRAFT_HEAD_MIN = 1024           # ... and at least this many (draft_head_rows)
AUTO_ROWS = -1                  # FlashOptions.draft_rows: as many as draft_head_rows gives
AUTO_DRAFT = 6                  # guesses a pass may check when `run` drafts by default (self)
READ_GIB_S = 2.0                # the auto predictor rule's device and DRAM speeds: only their
DRAM_GIB_S = 10.0               # ratio matters (measured: docs/MEASUREMENTS.md, "Device and DRAM")
GATHER_COST = 1.5              # a predicted pass's FFN computes scattered rows: measured ~1.5x
                                # the time per byte of a static pass's (docs/PREDICTOR.md)
PREDICTOR_MARGIN = 1.25         # auto takes a predictor only when expected this much faster: the
                                # rule's error, measured against runs (docs/PREDICTOR.md)


@dataclass(frozen=True)
class FlashOptions:
    """The flash-related options of `run`."""

    dram_budget: Optional[str] = None     # "1.5GiB", "560MiB", "50%"; None: no budget
    window: Optional[int] = None          # tokens whose neurons stay cached; None: by activation
    naive: bool = False                   # read every bundle every token (the paper's baseline)
    dense: bool = False                   # every bundle in DRAM (today's default)
    check: bool = False                   # also compute the exact mask: predictor recall
    predictor: str = "auto"               # auto: only when it is expected to pay; on; off
    keep_tokenizer: bool = False          # chat: the tokenizers object stays loaded
    draft_rows: int = 0                   # self-speculation: output head rows its draft holds
                                          # when the head streams (runtime/resident.py);
                                          # AUTO_ROWS: as the plan allows
    sparse_head: str = "off"              # the output head read sparsely when it streams
                                          # (runtime/sparse_head.py): off; auto, when calibration
                                          # measured that a token then reads less; on
    head_top: int = 1                     # the sampler keeps its top k logits (0: by margin)

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
    if opts.predictor not in PREDICTOR_MODES:
        raise BudgetError(f"--predictor {opts.predictor!r}: expected one of {', '.join(PREDICTOR_MODES)}")
    man = read_manifest(path)
    text = opts.dram_budget or "100%"
    if opts.dram_budget is None:   # --naive alone: no limit, the whole model's worth
        text = f"{model_bytes(man) + (1 << 30)}"
    kwargs = dict(reader_stage=READER_THREADS * READER_STAGE, naive=opts.naive,
                  keep_tokenizer=opts.keep_tokenizer,
                  sketch=_sketch(man, opts))
    try:
        plan = plan_budget(man, text, n_ctx, process, **kwargs)
        if opts.draft_rows and not opts.naive:
            plan = _with_draft(man, text, n_ctx, process, plan, opts.draft_rows, kwargs)
    except BudgetError as e:
        least = least_budget(man, n_ctx, process, **kwargs)
        raise BudgetError(f"{e} (the least --dram-budget that works for this model and context: "
                          f"{format_size(least, 'MiB', up=True)})") from None
    if not opts.naive and opts.predictor != "off" and man.get("predictor"):
        plan = _with_predictor(man, text, n_ctx, process, plan, opts)
    elif opts.predictor == "on" and not opts.naive:
        raise BudgetError(f"--predictor on: {path} has no predictor (run `flashllm calibrate`)")
    if not plan.predictor and not opts.naive:    # the same slots every token: all rows pinned
        plan = dataclasses.replace(plan, n_pinned=plan.capacity)
    if opts.dense and plan.capacity < plan.n_ff:
        need = plan.total - plan.cache_bytes + plan.n_ff * plan.strides
        need_s, have = format_size(need, "MiB", up=True), format_size(plan.budget, "MiB", up=False)
        raise BudgetError(f"--dense needs {need_s} (every FFN bundle in DRAM), --dram-budget "
                          f"{opts.dram_budget} gives {have}: drop --dense to stream the FFN from "
                          f"flash")
    return plan


def _sketch(man: dict, opts: FlashOptions) -> tuple[int, int]:
    """What a sparse head would keep and read (sparse_head.sketch_bytes) for the planner."""
    if opts.sparse_head == "off":
        return 0, 0
    return sketch_bytes(man, ROWS_STAGING, opts.head_top, forced=opts.sparse_head == "on")


def least_budget(man: dict, n_ctx: int, process: int, **kwargs) -> int:
    """The smallest budget (bytes, to 1 MiB) that plan_budget accepts, by bisection: the plan is
    arithmetic on the manifest, so this costs nothing next to a run."""
    lo, hi = 0, 4 * model_bytes(man) + process + (1 << 30)   # refused / accepted
    while hi - lo > (1 << 20):
        mid = (lo + hi) // 2
        try:
            plan_budget(man, str(mid), n_ctx, process, **kwargs)
            hi = mid
        except BudgetError:
            lo = mid
    return hi


def draft_head_rows(man: dict, plan: BudgetPlan, n_ctx: int) -> int:
    """The output head rows a self draft holds when the head streams (AUTO_ROWS): the first
    DRAFT_HEAD_ROWS token ids (a byte-level BPE's most frequent) where DRAFT_HEAD_SHARE of the
    caches' DRAM in plan (without the draft) holds them with the context's, fewer down to
    DRAFT_HEAD_MIN where the caches are small: a few more neurons a layer then make the draft
    agree more than rare tokens' rows do (docs/PREDICTOR.md, "The draft's head rows by the
    caches")."""
    fit = head_rows_fit(man, int(DRAFT_HEAD_SHARE * plan.cache_bytes), n_ctx)
    return max(DRAFT_HEAD_MIN, min(DRAFT_HEAD_ROWS, fit))


def _with_draft(man: dict, text: str, n_ctx: int, process: int, plan, rows: int, kwargs: dict):
    """The plan with a self draft's DRAM in kwargs["draft"]: its head rows when the head streams
    (rows; AUTO_ROWS: draft_head_rows), then the cold output it borrows where the caches hold
    enough to lend it (resident.carries)."""
    held = 0
    if head_name(man) in plan.streamed:
        held = draft_head_rows(man, plan, n_ctx) if rows == AUTO_ROWS else rows
        kwargs["draft"] = head_rows_bytes(man, held, n_ctx)
        plan = plan_budget(man, text, n_ctx, process, **kwargs)
    if not man["config"].get("n_experts") and carries(plan.capacity, plan.n_ff):
        kwargs["draft"] = kwargs.get("draft", 0) + carry_bytes(man)
        plan = plan_budget(man, text, n_ctx, process, **kwargs)
    return dataclasses.replace(plan, draft_rows=held)


def _with_predictor(man: dict, text: str, n_ctx: int, process: int, plain: BudgetPlan,
                    opts: FlashOptions) -> BudgetPlan:
    """The plan with the manifest's predictor resident when forced (--predictor on), or when it
    is expected to make a token faster than `plain` (the same budget without it); else plain."""
    sec, force = man["predictor"], opts.predictor == "on"
    size = format_size(int(sec.get("bytes") or 0), "MiB", up=True)
    try:
        plan = plan_budget(man, text, n_ctx, process, predictor=int(sec.get("nbytes") or 0),
                           reader_stage=READER_THREADS * READER_STAGE,
                           keep_tokenizer=opts.keep_tokenizer,
                           draft=plain.resident.get("draft", 0),
                           sketch=_sketch(man, opts) if plain.sparse_head else (0, 0))
    except BudgetError:
        if force:
            raise
        return dataclasses.replace(plain, notes=plain.notes + (
            f"predictor {sec.get('kind')} not used: its {size} do not fit the budget",))
    loads = sec.get("load") or [1.0]
    load = float(np.mean(loads)) if all(isinstance(v, (int, float)) for v in loads) else 1.0
    with_it = token_seconds(plan, load, int(sec.get("bytes") or 0), read_ahead=False)
    if force or PREDICTOR_MARGIN * with_it < token_seconds(plain, 1.0, 0, read_ahead=True):
        return dataclasses.replace(plan, predictor=True, draft_rows=plain.draft_rows,
                                   notes=plan.notes + (
            f"predictor {sec.get('kind')} resident ({size}, "
            f"{load:.0%} of the neurons per token)",))
    return dataclasses.replace(plain, notes=plain.notes + (
        f"predictor {sec.get('kind')} not used: it costs {size} of DRAM "
        f"and is not expected to make a token faster within this budget (--predictor on forces it)",))


def token_seconds(plan: BudgetPlan, load: float, predictor_bytes: int, read_ahead: bool) -> float:
    """Estimated seconds per decode token of a plan: FFN bundles read for a `load` share of
    the neurons outside the caches (plus the dense weights it streams) at READ_GIB_S, and the
    bytes the FFN and the predictor touch in DRAM at DRAM_GIB_S. With `read_ahead` (a static
    pass: the same bundles every token) the reads overlap the compute; a predicted pass
    learns what to read only at each layer, so its reads and compute add up, and its FFN
    gathers scattered rows (GATHER_COST)."""
    ffn = plan.n_ff * plan.strides
    read = load * (1.0 - plan.cache_fraction) * ffn + plan.streamed_bytes
    touched = load * ffn * (1.0 if read_ahead else GATHER_COST) + predictor_bytes
    read_s, touch_s = read / (READ_GIB_S * 2**30), touched / (DRAM_GIB_S * 2**30)
    return max(read_s, touch_s) if read_ahead else read_s + touch_s


def drafts_by_default(flash: FlashModel, opts: FlashOptions, plain: Optional[BudgetPlan]) -> bool:
    """Whether `run` without --draft drafts from the resident model (--draft-kind self): when
    `plain`, the plan without a draft, streams the FFN of a dense-FFN model from caches that
    hold some but not all of its neurons (with all of them the draft would be the model), with
    every layer's attention resident (what the draft computes from) and no predictor. The
    guesses a pass checks are learned from acceptance (speculate.DraftLength: none when they do
    not pay); measured: BENCHMARKS.md."""
    if plain is None or opts.naive or opts.dense or opts.check or plain.predictor \
            or flash.config.n_experts or not 0 < plain.capacity < plain.n_ff:
        return False
    return not any(n.startswith("blk.") for n in plain.streamed)


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
