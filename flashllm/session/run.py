"""A run assembled: its manifest read once, a models.toml model's own conversion calibrated
once, opened, its prompt tokenized, its plan chosen for that context (each candidate once,
refusing a budget before the model loads), its drafting settled, its network built. `run` and
`run -i` assemble this way; so will a server (one model opened, a sampler and a drafter per
stream).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from flashllm.errors import FlashError
from flashllm.runtime.plan import AUTO_DRAFT

Log = Callable[[str], None]


@dataclass(frozen=True)
class Drafting:
    """What drafts a run's guesses: n guesses at most (0: none) of kind "lookup" or "self";
    auto: the run decides once its plan is known (a one-shot run under a budget, no --draft)."""

    n: int
    kind: str
    auto: bool = False

    @property
    def is_self(self) -> bool:
        return self.n > 0 and self.kind == "self"

    @classmethod
    def asked(cls, draft: Optional[int], kind: Optional[str], budget: bool,
              auto: bool) -> "Drafting":
        """From --draft / --draft-kind (kind None: not given); refuses a self draft without a
        budget. Auto only under a budget, never for --naive, --dense or a chat (measured on
        one-shot runs only: BENCHMARKS.md)."""
        name = kind if kind is not None else "lookup"
        n = draft if draft is not None else AUTO_DRAFT if kind is not None else 0
        if n > 0 and name == "self" and not budget:
            raise FlashError("--draft-kind self drafts from the part of the model a --dram-budget "
                             "keeps in DRAM: give --dram-budget (with everything in DRAM, use "
                             "--draft-kind lookup)")
        return cls(n, name, auto and budget and draft is None and kind is None)


@dataclass(frozen=True)
class RunRequest:
    """What a run asks for: the converted folder, its flash options (runtime FlashOptions), the
    sampler's head need (sparse_head.head_need), threads, the context, the drafting asked, the
    self draft's head rows (AUTO_ROWS: the plan's), a one-shot prompt (text, n_predict,
    ctx_size; None: a chat), whether to calibrate the conversion once (a models.toml name's
    or a GGUF's, never a folder the user gave) and how many networks to build (a server's
    streams: each its own KV cache of n_ctx positions over one FFN and one set of weights;
    the plan holds them all)."""

    path: Path
    flash: object
    need: object
    threads: int
    n_ctx: int
    drafting: Drafting
    head_rows: int
    one_shot: Optional[tuple] = None
    calibrate: str = ""               # the model as the user named it, when its conversion is ours
    streams: int = 1
    constrained: bool = False         # a grammar's token table is built after the plan: its
                                      # memory is set aside (generation/grammar.table_bytes)


@dataclass
class Parts:
    """A run's model, assembled: what it reads from, its tokenizer and prompt ids (None in a
    chat), the network (and every stream's: nets[0] is net) and the flash parts to close, and
    the drafting the plan settled."""

    flash: object
    tok: object
    ids: Optional[list]
    net: object
    ffn: object
    weights: object
    head: object
    drafting: Drafting
    head_rows: int                # the output head rows a self draft holds (the plan's)
    nets: list = field(default_factory=list)   # a network per stream (RunRequest.streams)

    def close(self) -> None:
        for part in (self.ffn, self.weights):
            if part is not None:
                part.close()


@dataclass(frozen=True)
class FlashAsked:
    """`run`'s flash options as given: the budget, --window, --naive, --dense, --check-recall,
    --predictor, --sparse-head (None: by calibration), --draft-head-rows (None: the plan's)."""

    dram_budget: object = None        # a Budget (runtime/budget.parse_budget); None: none
    window: Optional[int] = None
    naive: bool = False
    dense: bool = False
    check: bool = False
    predictor: str = "auto"
    sparse_head: Optional[bool] = None
    draft_head_rows: Optional[int] = None


def request(path: Path, asked: FlashAsked, sampling, drafting: Drafting, threads: int,
            ctx_size: int, one_shot: Optional[tuple], calibrate: str = "",
            constrained: bool = False) -> RunRequest:
    """The RunRequest of `run` (one_shot: (text, n_predict); None: a chat, whose context is
    ctx_size): a one-shot run's context first bounded by the prompt's bytes, the tokenizer kept
    in a chat or where it cannot decode through a byte table. calibrate: the model as the user
    named it when its conversion is flashllm's own (a name's, a .gguf's), calibrated once under a
    budget; "" for a folder the user gave. constrained: a grammar constrains the output (its
    token table's memory is counted with the process's)."""
    from flashllm.runtime.plan import AUTO_ROWS, FlashOptions
    need = sampling.head_need() if asked.sparse_head is not False else None
    rows = asked.draft_head_rows or AUTO_ROWS     # the draft's head rows: asked, or the plan's
    fopts = FlashOptions(asked.dram_budget, asked.window, asked.naive, asked.dense, asked.check,
                         asked.predictor,
                         keep_tokenizer=one_shot is None or not releases_tokenizer(path),
                         draft_rows=rows if drafting.is_self else 0,
                         sparse_head="off" if need is None else "on" if asked.sparse_head
                         else "auto", head_top=need.top if need is not None else 1)
    n_ctx = ctx_size
    if one_shot is not None:
        text, n_predict = one_shot
        n_ctx = min(ctx_size, len(text.encode()) + n_predict + 2)
        one_shot = (text, n_predict, ctx_size)
    return RunRequest(path, fopts, need, threads, n_ctx, drafting, rows, one_shot, calibrate,
                      constrained=constrained)


def assemble(req: RunRequest, cache: Path, log: Log) -> Parts:
    """Check what must hold before anything loads (the options, the budget for the context's
    bound: a refused budget loads and calibrates nothing), calibrate a models.toml model's own
    conversion once under a budget, open, tokenize a one-shot prompt, choose the plan for its
    context (runtime/plan.choose_plan: each candidate once, before the model loads) and build
    the network."""
    from flashllm.format.integrity import verify_on_first_load
    from flashllm.format.manifest import read_manifest
    from flashllm.format.reader import open_flash
    from flashllm.generation.tokenizer import Tokenizer
    from flashllm.runtime.assemble import make_parts
    from flashllm.runtime.plan import check_before_loading, check_context_memory, choose_plan
    from flashllm.session.calibration import calibrate_once, is_calibrated
    from flashllm.ffi.heap import trim_heap
    from flashllm.runtime.budget import process_rss
    from flashllm.runtime.model import Model
    load_code()
    trim_heap()                      # the imports' freed heap: ~1 MiB the plan need not count
    man = read_manifest(req.path)
    process = process_rss() + set_aside(req, man)
    held = req.n_ctx * req.streams                  # the positions every KV cache holds
    check_context_memory(open_flash(req.path, manifest=man).config,   # a bad folder: refused
                         held)                      # naming its fault, before any size from it
    check_before_loading(man, req.flash, held, process)
    if req.calibrate and req.flash.flash and not is_calibrated(man) and \
            calibrate_once(req.path, log, req.calibrate, req.flash.dram_budget):
        process = process_rss() + set_aside(req, man)   # the plan of the calibrated folder
        man = read_manifest(req.path)
        check_before_loading(man, req.flash, held, process)
    flash = open_flash(req.path, manifest=man)
    try:
        verify_on_first_load(flash)
    except FlashError as e:                       # a damaged folder: say how to make it anew
        raise FlashError(f"{e}; {repair_hint(req.path, req.calibrate)}") from None
    tok = Tokenizer.from_flash(flash, word_cache=req.one_shot is None)   # one-shot: encodes once
    ids, n_ctx = None, req.n_ctx
    if req.one_shot is not None:     # the KV cache holds the prompt and the tokens to make
        text, n_predict, ctx_size = req.one_shot
        ids = prompt_ids(tok, text, n_predict, ctx_size, flash.config.max_positions)
        n_ctx = len(ids) + n_predict
    trained = flash.config.context_length
    if n_ctx > trained and flash.config.max_positions is None:
        log(f"warning: a context of {n_ctx} tokens is past the {trained} the model was trained "
            "on: text beyond them may lose coherence")
    drafting = req.drafting
    choice = choose_plan(man, req.flash, n_ctx * req.streams, process,
                         auto_rows=req.head_rows if drafting.auto else 0, streams=req.streams)
    if drafting.auto:
        drafting = Drafting(AUTO_DRAFT, "self") if choice.auto_drafted else \
            Drafting(0, drafting.kind)
    plan, fopts = choice.plan, choice.options
    if plan is not None and req.one_shot is not None:
        tok.release(keep_source=False)   # never encodes again; decoding needs only the table
    ffn, weights, head = make_parts(flash, fopts, plan, req.need, req.threads, cache, log=log)
    net = Model(flash, n_threads=req.threads, n_ctx=n_ctx, ffn=ffn, weights=weights,
                kv_dtype="f16", head=head)
    nets = [net] + [net.new_stream() for _ in range(req.streams - 1)]
    return Parts(flash, tok, ids, net, ffn, weights, head, drafting,
                 plan.draft_rows if plan is not None else 0, nets)


def set_aside(req: RunRequest, man) -> int:
    """Bytes the run will hold besides what its plan places: a grammar's token table (lean
    under a budget: session/structured.token_env_of)."""
    if not req.constrained:
        return 0
    from flashllm.generation.grammar import table_bytes
    return table_bytes(man["config"]["vocab_size"], lean=req.flash.dram_budget is not None)


def repair_hint(path: Path, name: str) -> str:
    """How to replace a damaged converted folder: flashllm's own conversion of name (a models.toml
    name or a GGUF file: "" for a folder the user gave) is removed and made again by the next run;
    a user's folder is converted again from its source."""
    if name:
        return (f"{path} is flashllm's own conversion of {name}: remove it (rm -r '{path}') and "
                f"run again to convert it anew")
    return f"convert its source again: flashllm convert SOURCE -o '{path}' --force"


def prompt_ids(tok, text: str, n_predict: int, ctx_size: int,
               positions: Optional[int]) -> list[int]:
    """The prompt's ids, which with n_predict more fit --ctx-size and the model's positions
    (learned position embeddings: config.max_positions; None: no such limit)."""
    ids = tok.encode(text, add_special=True)
    if not ids:
        raise FlashError("the prompt is empty (no tokens to start from)")
    if positions is not None and positions < ctx_size and len(ids) + n_predict > positions:
        raise FlashError(f"prompt ({len(ids)} tokens) + --n-predict {n_predict} exceed the "
                         f"model's {positions} positions (learned position embeddings)")
    if len(ids) + n_predict > ctx_size:
        raise FlashError(f"prompt ({len(ids)} tokens) + --n-predict {n_predict} exceed "
                         f"--ctx-size {ctx_size}")
    return ids


def drafter(net, sampler, drafting: Drafting, p_min: float, head_rows: int, resident=None):
    """The --draft guesser of one stream: None (off), prompt lookup, or the resident model
    (resident: the stream's, already built; None: built for net here)."""
    from flashllm.generation.speculate import NgramDraft
    if not drafting.n:
        return None
    if drafting.kind == "lookup":
        return NgramDraft(drafting.n)
    from flashllm.generation.self_draft import SelfDraft
    if resident is None:
        from flashllm.runtime.resident import resident_model
        resident = resident_model(net, head_rows)
    return SelfDraft(resident, sampler, drafting.n, p_min)


class StreamDrafts:
    """A server's drafting (the plan's, as `run` drafts): each stream's self draft computes
    from its resident model, built once a stream over its KV cache (runtime/resident.py's
    stream_residents: one head-rows table for all, the plan holds it), and each request gets
    a new drafter with its sampler."""

    def __init__(self, parts: Parts, p_min: float):
        from flashllm.runtime.resident import stream_residents
        self.drafting, self.p_min = parts.drafting, p_min
        self.residents = stream_residents(parts.nets, parts.head_rows) \
            if parts.drafting.is_self else [None] * len(parts.nets)

    def carries(self) -> list:
        """Each stream's ColdCarry (None: none), which its passes record for its draft."""
        return [getattr(r.ffn, "carry", None) if r is not None else None
                for r in self.residents]

    def new(self, stream: int, sampler):
        """The drafter of a request on stream (None: drafting is off)."""
        return drafter(None, sampler, self.drafting, self.p_min, 0, self.residents[stream])


def load_code() -> None:
    """Import the code a run loads once it has started (the FFN strategies, generation, numpy's
    random and masked arrays: ~4.5 MiB), so the process size a --dram-budget plan measures
    already holds it."""
    import numpy.ma  # noqa: F401
    import numpy.random  # noqa: F401
    import flashllm.generation.generate  # noqa: F401
    import flashllm.runtime.sparse_ffn  # noqa: F401


def releases_tokenizer(path: Path) -> bool:
    """Whether the model's tokenizer decodes through a byte table, so a one-shot run can release
    it after the prompt (a budget then counts it small): read from tokenizer.json's decoder
    before anything loads."""
    from flashllm.format.layout import TOKENIZER_FILE
    from flashllm.generation.tokenizer import decodes_through_table
    return decodes_through_table(path / TOKENIZER_FILE)
