"""The plan of a run, as data: its flash options, and choose_plan, which builds each candidate
plan once — plain, with a self draft's DRAM, with the predictor resident — from the manifest
alone (budget.plan_budget: arithmetic, nothing loaded) and keeps the one that is expected to
make tokens fastest, or refuses naming the least budget that works.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

from flashllm.runtime.budget import BudgetPlan, check_budget, head_name, model_bytes, plan_budget
from flashllm.runtime.budget_given import Budget, BudgetError
from flashllm.runtime.resident import carries, carry_bytes, head_rows_bytes, head_rows_fit
from flashllm.runtime.sparse_head import sketch_bytes
from flashllm.errors import FlashError
from flashllm.units import KiB, format_size

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
MAX_DRAFT = 256                # guesses a pass may check at most (--draft): far past any that pays
READ_GIB_S = 2.0                # the auto predictor rule's device and DRAM speeds: only their
DRAM_GIB_S = 10.0               # ratio matters (measured: docs/MEASUREMENTS.md, "Device and DRAM")
GATHER_COST = 1.5              # a predicted pass's FFN computes scattered rows: measured ~1.5x
                                # the time per byte of a static pass's (docs/PREDICTOR.md)
PREDICTOR_MARGIN = 1.25         # auto takes a predictor only when expected this much faster: the
                                # rule's error, measured against runs (docs/PREDICTOR.md)


@dataclass(frozen=True)
class FlashOptions:
    """The flash-related options of `run`."""

    dram_budget: Optional[Budget] = None  # parsed at the boundary (budget.parse_budget); None: none
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


@dataclass(frozen=True)
class Choice:
    """choose_plan's answer: the plan (None: no budget, everything in DRAM), the options it was
    made with (draft_rows as chosen: 0 when it holds no self draft) and whether it holds a self
    draft that `run` drafts with by default."""

    plan: Optional[BudgetPlan]
    options: FlashOptions
    auto_drafted: bool = False


def choose_plan(man, opts: FlashOptions, n_ctx: int, process: int,
                auto_rows: int = 0, streams: int = 1) -> Choice:
    """The plan of a run (man: the folder's Manifest): each candidate built once. With
    auto_rows (a run without --draft) a self draft holding those head rows (AUTO_ROWS: as
    draft_head_rows gives) when drafts_by_default finds it pays in the plain plan and in its
    own; BudgetError naming the least budget that works when none fits. streams: the
    networks sharing the model (a server's: n_ctx counts all their positions), each with its
    own self draft."""
    _check(opts)
    if opts.dram_budget is None and not opts.naive:
        return Choice(None, opts)
    budget = opts.dram_budget or Budget.of_bytes(model_bytes(man) + (1 << 30))   # --naive alone
    base = _base(man, opts)
    plain = _plan_or_least(man, budget, n_ctx, process, base)
    plan, chosen, auto = plain, opts, False
    if opts.draft_rows and not opts.naive:                       # asked: it must fit
        plan = _drafted(man, budget, n_ctx, process, base, plain, opts.draft_rows, streams,
                        least=True)
    plan = _predictor(man, budget, n_ctx, process, plan, opts)
    if auto_rows and not opts.draft_rows and drafts_by_default(man, opts, plan):
        drafted = dataclasses.replace(opts, draft_rows=auto_rows)
        try:
            with_rows = _drafted(man, budget, n_ctx, process, base, plain, auto_rows, streams)
        except BudgetError:          # the head rows do not fit: plain decoding
            with_rows = None
        if with_rows is not None and drafts_by_default(man, drafted, with_rows):
            plan = dataclasses.replace(with_rows, notes=plan.notes)
            chosen, auto = drafted, True     # else they pushed attention out of DRAM
    return Choice(_finish(plan, chosen), chosen, auto)


def check_before_loading(man, opts: FlashOptions, n_ctx: int, process: int) -> None:
    """What a run refuses before it loads anything, the tokenizer included: its options, and a
    budget that cannot hold what must stay resident for a context of n_ctx (a one-shot run's
    bound: the prompt's bytes + -n) — plan_budget's refusals alone (budget.check_budget), no
    plan; choose_plan makes that once the prompt is tokenized. A refusal names the least
    budget that works."""
    _check(opts)
    if opts.dram_budget is None:
        return
    base = _base(man, opts)
    try:
        check_budget(man, opts.dram_budget, n_ctx, process, **base)
    except BudgetError as e:
        raise _with_least(e, man, n_ctx, process, base) from None


def check_context_memory(cfg, n_ctx: int) -> None:
    """FlashError (one line) when n_ctx's KV cache (f16 keys and values, every layer) of the
    model of cfg (a validated ModelConfig: an open folder's) could not fit this machine's
    memory at all: -c 99999999 is refused, not allocated."""
    kv = 2 * 2 * cfg.n_layers * n_ctx * cfg.n_kv_heads * cfg.head_dim     # bytes
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if kv > ram:
        raise FlashError(f"a context of {n_ctx} tokens needs {format_size(kv, 'GiB', up=True)} "
                         f"of KV cache, more than this machine's {format_size(ram, 'GiB')} of "
                         f"memory: lower --ctx-size")


def _base(man, opts: FlashOptions) -> dict:
    """plan_budget's arguments every candidate of a run shares."""
    return dict(reader_stage=READER_THREADS * READER_STAGE, naive=opts.naive,
                keep_tokenizer=opts.keep_tokenizer, sketch=_sketch(man, opts))


def _check(opts: FlashOptions) -> None:
    if opts.dense and opts.naive:
        raise BudgetError("give --dense or --naive, not both")
    if opts.window is not None and opts.window < 1:
        raise BudgetError(f"--window {opts.window} must be at least 1")
    if opts.predictor not in PREDICTOR_MODES:
        raise BudgetError(f"--predictor {opts.predictor!r}: expected one of "
                          f"{', '.join(PREDICTOR_MODES)}")


def _plan_or_least(man, budget: Budget, n_ctx: int, process: int, kwargs: dict) -> BudgetPlan:
    """plan_budget, or its refusal with the least budget that works for the same candidate."""
    try:
        return plan_budget(man, budget, n_ctx, process, **kwargs)
    except BudgetError as e:
        raise _with_least(e, man, n_ctx, process, kwargs) from None


def _with_least(e: BudgetError, man, n_ctx: int, process: int, kwargs: dict) -> BudgetError:
    """e's refusal, naming the least budget that works for the same arguments (least_budget)."""
    least = format_size(least_budget(man, n_ctx, process, **kwargs), "MiB", up=True)
    said = re.sub(r"give at least [0-9]+ MiB", f"give at least {least}", str(e))   # one minimum
    return BudgetError(f"{said} (the least --dram-budget that works for this model and context: "
                       f"{least})")


def _finish(plan: BudgetPlan, opts: FlashOptions) -> BudgetPlan:
    """The chosen plan's pins (all rows when the same slots serve every token), or the refusal
    of --dense where the caches cannot hold the whole FFN."""
    if not plan.predictor and not opts.naive:    # the same slots every token: all rows pinned
        plan = dataclasses.replace(plan, n_pinned=plan.capacity)
    if opts.dense and plan.capacity < plan.n_ff:
        need = plan.total - plan.cache_bytes + plan.n_ff * plan.strides
        need_s, have = format_size(need, "MiB", up=True), format_size(plan.budget, "MiB", up=False)
        raise BudgetError(f"--dense needs {need_s} (every FFN bundle in DRAM), --dram-budget "
                          f"{opts.dram_budget.text} gives {have}: drop --dense to stream the "
                          f"FFN from flash")
    return plan


def _sketch(man, opts: FlashOptions) -> tuple[int, int]:
    """What a sparse head would keep and read (sparse_head.sketch_bytes) for the planner."""
    if opts.sparse_head == "off":
        return 0, 0
    return sketch_bytes(man, ROWS_STAGING, opts.head_top, forced=opts.sparse_head == "on")


def least_budget(man, n_ctx: int, process: int, **kwargs) -> int:
    """The smallest budget (bytes, to 1 MiB) that plan_budget accepts, by bisection: the plan is
    arithmetic on the manifest, so this costs nothing next to a run. The upper end is doubled
    until it is accepted (a long context's KV cache can pass the model's size many times)."""
    lo, hi = 0, 4 * model_bytes(man) + process + (1 << 30)   # refused / accepted
    while not _accepts(man, hi, n_ctx, process, kwargs):
        lo, hi = hi, 2 * hi
    while hi - lo > (1 << 20):
        mid = (lo + hi) // 2
        try:
            plan_budget(man, Budget.of_bytes(mid), n_ctx, process, **kwargs)
            hi = mid
        except BudgetError:
            lo = mid
    return hi


def _accepts(man, nbytes: int, n_ctx: int, process: int, kwargs: dict) -> bool:
    try:
        plan_budget(man, Budget.of_bytes(nbytes), n_ctx, process, **kwargs)
        return True
    except BudgetError:
        return False


def draft_head_rows(man, plan: BudgetPlan, n_ctx: int) -> int:
    """The output head rows a self draft holds when the head streams (AUTO_ROWS): the first
    DRAFT_HEAD_ROWS token ids (a byte-level BPE's most frequent) where DRAFT_HEAD_SHARE of the
    caches' DRAM in plan (without the draft) holds them with the context's, fewer down to
    DRAFT_HEAD_MIN where the caches are small: a few more neurons a layer then make the draft
    agree more than rare tokens' rows do (docs/PREDICTOR.md, "The draft's head rows by the
    caches")."""
    fit = head_rows_fit(man, int(DRAFT_HEAD_SHARE * plan.cache_bytes), n_ctx)
    return max(DRAFT_HEAD_MIN, min(DRAFT_HEAD_ROWS, fit))


def _drafted(man, budget: Budget, n_ctx: int, process: int, base: dict, plain: BudgetPlan,
             rows: int, streams: int = 1, least: bool = False) -> BudgetPlan:
    """The candidate with the self drafts' DRAM (_draft_bytes; plain itself when they need
    none); with `least` a refusal names the least budget that holds it."""
    draft, held = _draft_bytes(man, plain, n_ctx, rows, streams)
    if not draft:
        return dataclasses.replace(plain, draft_rows=held)
    kwargs = {**base, "draft": draft}
    plan = _plan_or_least(man, budget, n_ctx, process, kwargs) if least else \
        plan_budget(man, budget, n_ctx, process, **kwargs)
    return dataclasses.replace(plan, draft_rows=held)


def _draft_bytes(man, plain: BudgetPlan, n_ctx: int, rows: int,
                 streams: int = 1) -> tuple[int, int]:
    """(DRAM of the self drafts of streams networks, the head rows they hold) by the plain
    plan: their head rows when the head streams (rows; AUTO_ROWS: draft_head_rows), shared
    with the context's tokens of all (n_ctx: every stream's positions), and the cold output
    each borrows where the plain plan's caches hold enough to lend it (resident.carries)."""
    held = 0
    if head_name(man) in plain.streamed:
        held = draft_head_rows(man, plain, n_ctx) if rows == AUTO_ROWS else rows
    draft = head_rows_bytes(man, held, n_ctx) if held else 0
    if not man["config"].get("n_experts") and carries(plain.capacity, plain.n_ff):
        draft += streams * carry_bytes(man)
    return draft, held


def _predictor(man, budget: Budget, n_ctx: int, process: int, plain: BudgetPlan,
               opts: FlashOptions) -> BudgetPlan:
    """The plan with the manifest's predictor resident when forced (--predictor on), or when it
    is expected to make a token faster than `plain` (the same budget without it); else plain."""
    sec = man.get("predictor")
    if opts.naive or opts.predictor == "off" or not sec:
        if opts.predictor == "on" and not opts.naive:
            raise BudgetError(f"--predictor on: {man.path.parent} has no predictor (run "
                              f"`flashllm calibrate`)")
        return plain
    force = opts.predictor == "on"
    size = format_size(int(sec.get("bytes") or 0), "MiB", up=True)
    try:
        plan = plan_budget(man, budget, n_ctx, process, predictor=int(sec.get("nbytes") or 0),
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


def drafts_by_default(man, opts: FlashOptions, plain: Optional[BudgetPlan]) -> bool:
    """Whether `run` without --draft drafts from the resident model (--draft-kind self): when
    `plain`, the plan without a draft, streams the FFN of a dense-FFN model from caches that
    hold some but not all of its neurons (with all of them the draft would be the model), with
    every layer's attention resident (what the draft computes from) and no predictor. The
    guesses a pass checks are learned from acceptance (speculate.DraftLength: none when they do
    not pay); measured: BENCHMARKS.md."""
    if plain is None or opts.naive or opts.dense or opts.check or plain.predictor \
            or man["config"].get("n_experts") or not 0 < plain.capacity < plain.n_ff:
        return False
    return not any(n.startswith("blk.") for n in plain.streamed)
