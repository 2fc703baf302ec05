"""`flashllm run`: one-shot completion, pipelines and chat (commands registered on cli.app).

Generated tokens go alone to stdout; timings, stats and errors to stderr.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from flashllm.runtime.assemble import AUTO_DRAFT, AUTO_ROWS, DRAFT_KINDS, PREDICTOR_MODES
from flashllm.cli.app import (MODEL_HELP, DEFAULT_THREADS, MAX_THREADS, cache_dir, choice,
                              command, err, fail, model_path)
from flashllm.cli.progress import eta_progress
from flashllm.cli.prompt_io import read_line, read_prompt, read_tty

PredictorMode = choice("PredictorMode", PREDICTOR_MODES)
DraftKind = choice("DraftKind", DRAFT_KINDS)


@command
def run(
    model: str = typer.Argument(..., help=MODEL_HELP),
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="Prompt text; '-' reads stdin."),
    file: Optional[Path] = typer.Option(None, "-f", "--file", help="Read the prompt from a file (- : stdin)."),
    n_predict: Optional[int] = typer.Option(None, "-n", "--n-predict", min=1, help="Tokens to "
                                            "generate (default 128; in a chat, per answer: a "
                                            "quarter of the context)."),
    ctx_size: int = typer.Option(2048, "-c", "--ctx-size", min=1, help="Context length (KV cache size; a "
                                 "one-shot prompt needs only its tokens + -n)."),
    threads: int = typer.Option(DEFAULT_THREADS, "-t", "--threads", min=1, max=MAX_THREADS,
                               help="Compute threads."),
    temp: float = typer.Option(0.8, "--temp", min=0.0, help="Temperature; 0 is greedy."),
    top_k: int = typer.Option(40, "--top-k", min=0, help="Keep the k most likely tokens; 0 disables."),
    top_p: float = typer.Option(0.95, "--top-p", min=0.0, max=1.0, help="Nucleus sampling mass; 1 disables."),
    min_p: float = typer.Option(0.05, "--min-p", min=0.0, max=1.0, help="Drop tokens below min_p × the top probability."),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty", min=0.0, help="Penalty on recent tokens; 1 disables."),
    repeat_last_n: int = typer.Option(64, "--repeat-last-n", min=0, help="How many recent tokens the penalty sees."),
    seed: Optional[int] = typer.Option(None, "--seed", min=-1,
                                       help="Random seed (default, or -1 as in llama.cpp: random)."),
    no_timings: bool = typer.Option(False, "--no-timings", help="Do not print the timings line."),
    dram_budget: Optional[str] = typer.Option(
        None, "--dram-budget", help="Stream the FFN from flash within this DRAM: 1.5GiB, 560MiB, "
        "or 50% of the converted model (default: everything in DRAM). A models.toml MODEL's "
        "conversion is calibrated once first (`flashllm calibrate`'s defaults)."),
    window: Optional[int] = typer.Option(
        None, "--window", min=1, help="Keep the neurons of the last K tokens cached (default 4; 2 for GLU)."),
    naive: bool = typer.Option(False, "--naive", help="Read every FFN bundle every token (baseline)."),
    dense: bool = typer.Option(False, "--dense", help="Every FFN bundle in DRAM (the default)."),
    predictor: PredictorMode = typer.Option("auto", "--predictor", help="With --dram-budget: use the model's "
                                  "predictor (from calibrate): auto (when it is expected to make "
                                  "tokens faster within the budget), on, or off."),
    draft: Optional[int] = typer.Option(None, "--draft", min=0, help="Speculative decoding: "
                                        "check up to N guessed tokens in each pass (as many as "
                                        "pay, learned while running; 0: off). Tokens are drawn "
                                        "from the same distributions. Default: under "
                                        f"--dram-budget, when the FFN streams, {AUTO_DRAFT} "
                                        "guesses of the model's resident part (--draft-kind "
                                        "self) in a one-shot run; else off."),
    draft_kind: Optional[DraftKind] = typer.Option(None, "--draft-kind", help="Where --draft's "
                                                   "guesses come from: lookup (the context's "
                                                   "n-grams; the default with --draft N; pays "
                                                   "where the answer repeats the context) or self "
                                                   "(the model's resident part under "
                                                   "--dram-budget: its cached neurons, no flash "
                                                   "read)."),
    draft_p_min: float = typer.Option(0.5, "--draft-p-min", min=0.0, max=1.0, help="--draft-kind "
                                      "self: stop drafting after a guess the draft gives less "
                                      "than this probability."),
    draft_head_rows: Optional[int] = typer.Option(None, "--draft-head-rows", min=1, hidden=True,
                                                  help="--draft-kind self with a streamed output "
                                                  "head: the first N token ids' rows the draft "
                                                  "holds (default: by the plan, at most 16384)."),
    sparse_head: Optional[bool] = typer.Option(
        None, "--sparse-head/--no-sparse-head", show_default=False, help="With --dram-budget, "
        "when the output head streams: stream its 2.6-bit sketch instead and read only the rows "
        "the sampler can keep (greedy, top-k or min-p). Default: when `flashllm calibrate` "
        "measured that a token then reads fewer bytes; --sparse-head: whenever the plan reads "
        "fewer; --no-sparse-head: never."),
    flash_stats: bool = typer.Option(False, "--stats", help="Per-token flash I/O, cache and latency "
                                     "table on stderr at the end."),
    check_recall: bool = typer.Option(False, "--check-recall", help="With --stats: also compute each "
                                      "token's exact mask for the predictor's recall (slow)."),
    interactive: bool = typer.Option(False, "-i", "--interactive", "--chat",
                                     help="Chat: multi-turn, with the model's chat template."),
    system: Optional[str] = typer.Option(None, "-sys", "--system", help="Chat: the system prompt."),
    chat_template: Optional[Path] = typer.Option(None, "--chat-template",
                                                 help="Chat: a Jinja template file to use instead "
                                                 "of the model's."),
    as_json: bool = typer.Option(False, "--json", help="Timings as one JSON object on stderr "
                                 "(instead of the text lines)."),
) -> None:
    """Generate text from a prompt (tokens stream to stdout as they are made), or chat (-i)."""
    from flashllm.runtime.assemble import FlashOptions
    from flashllm.runtime.sparse_head import head_need
    from flashllm.generation.sampler import Sampler, SamplerParams

    if interactive and (prompt is not None or file is not None):
        fail("give a prompt (-p/-f) or -i/--chat, not both")
    drafting = _Drafting.asked(draft, draft_kind, dram_budget is not None,
                               auto=not (naive or dense or interactive))
    if n_predict is None:        # a chat answer may run long; 0 there means a quarter of n_ctx
        n_predict = 0 if interactive else 128
    text = None if interactive else read_prompt(prompt, file)
    path = model_path(model, apart=dram_budget is not None)
    calibrate = None if Path(model).is_dir() or naive or dense else model  # ours: a name's, a .gguf's
    params = SamplerParams(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                           repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                           seed=None if seed == -1 else seed)
    need = head_need(params) if sparse_head is not False else None
    rows = draft_head_rows or AUTO_ROWS               # the draft's head rows: asked, or the plan's
    fopts = FlashOptions(dram_budget, window, naive, dense, check_recall, predictor.value,
                         keep_tokenizer=interactive or not _releases_tokenizer(path),
                         draft_rows=rows if drafting.is_self else 0,
                         sparse_head="off" if need is None else "on" if sparse_head else "auto",
                         head_top=need.top if need is not None else 1)
    n_ctx = ctx_size if interactive else min(ctx_size, len(text.encode()) + n_predict + 2)
    parts = _assemble(path, fopts, need, threads, n_ctx, drafting, rows,
                      None if interactive else (text, n_predict, ctx_size), calibrate)
    sampler = Sampler(params)
    try:
        drafter = _drafter(parts.net, sampler, parts.drafting, draft_p_min, parts.head_rows)
        if interactive:
            _chat(parts.flash, parts.net, parts.tok, sampler, system, chat_template, n_predict,
                  as_json, drafter)
        else:
            stats = _complete(parts.net, parts.tok, sampler, parts.ids, n_predict, drafter)
            _report(stats, parts, flash_stats, as_json, no_timings)
        if flash_stats and not as_json:
            _print_flash_stats(parts.ffn, parts.weights, parts.head)
    finally:                      # stop the read-ahead before the buffers go away
        parts.close()


@dataclass(frozen=True)
class _Drafting:
    """What drafts a run's guesses: n guesses at most (0: none) of kind "lookup" or "self";
    auto: the run decides once its plan is known (a one-shot run under a budget, no --draft)."""

    n: int
    kind: str
    auto: bool = False

    @property
    def is_self(self) -> bool:
        return self.n > 0 and self.kind == "self"

    @classmethod
    def asked(cls, draft: Optional[int], kind, budget: bool, auto: bool) -> "_Drafting":
        """From --draft / --draft-kind (kind None: not given); refuses a self draft without a
        budget. Auto only under a budget, never for --naive, --dense or a chat (measured on
        one-shot runs only: BENCHMARKS.md)."""
        name = kind.value if kind is not None else "lookup"
        n = draft if draft is not None else AUTO_DRAFT if kind is not None else 0
        if n > 0 and name == "self" and not budget:
            fail("--draft-kind self drafts from the part of the model a --dram-budget keeps in "
                 "DRAM: give --dram-budget (with everything in DRAM, use --draft-kind lookup)")
        return cls(n, name, auto and budget and draft is None and kind is None)


@dataclass
class _Parts:
    """A run's model, assembled: what it reads from, its tokenizer and prompt ids (None in a
    chat), the network and the flash parts to close, and the drafting the plan settled."""

    flash: object
    tok: object
    ids: Optional[list]
    net: object
    ffn: object
    weights: object
    head: object
    drafting: _Drafting
    head_rows: int                # the output head rows a self draft holds (the plan's)

    def close(self) -> None:
        for part in (self.ffn, self.weights):
            if part is not None:
                part.close()


def _assemble(path: Path, fopts, need, threads: int, n_ctx: int, drafting: _Drafting,
              head_rows: int, one_shot: Optional[tuple], calibrate: Optional[str] = None) -> _Parts:
    """Plan (refusing a budget before anything loads), calibrate a models.toml model's own
    conversion once under a budget (calibrate: the model as the user named it), open, tokenize
    a one-shot prompt (one_shot: (text, n_predict, ctx_size); None: a chat) and build the
    network."""
    from flashllm.format.integrity import verify_on_first_load
    from flashllm.format.reader import open_flash
    from flashllm.generation.tokenizer import Tokenizer
    from flashllm.cli.calibration import calibrate_once
    from flashllm.runtime.assemble import make_parts, plan_run
    from flashllm.ffi.heap import trim_heap
    from flashllm.runtime.budget import process_rss
    from flashllm.runtime.model import Model
    _load_code()
    trim_heap()                      # the imports' freed heap: ~1 MiB the plan need not count
    process = process_rss()
    plan = plan_run(path, fopts, n_ctx, process)     # refuses before loading anything
    log = lambda m: err.print(m, markup=False, soft_wrap=True)    # a line a message
    if calibrate and plan is not None and calibrate_once(path, log, calibrate, fopts.dram_budget):
        process = process_rss()                      # the plan of the calibrated folder
        plan = plan_run(path, fopts, n_ctx, process)
    flash = open_flash(path)
    verify_on_first_load(flash)
    tok = Tokenizer.from_flash(flash, word_cache=one_shot is None)   # one-shot: encodes once
    ids = None
    if one_shot is not None:     # the KV cache holds the prompt and the tokens to make
        text, n_predict, ctx_size = one_shot
        ids = _prompt_ids(tok, text, n_predict, ctx_size, flash.config.max_positions)
        n_ctx = len(ids) + n_predict
        plan = plan and plan_run(path, fopts, n_ctx, process)
    if drafting.auto:
        fopts, plan, on = _auto_self_draft(path, flash, fopts, plan, n_ctx, process, head_rows)
        drafting = _Drafting(AUTO_DRAFT, "self") if on else _Drafting(0, drafting.kind)
    if plan is not None and one_shot is not None:
        tok.release(keep_source=False)   # never encodes again; decoding needs only the table
    ffn, weights, head = make_parts(flash, fopts, plan, need, threads, cache_dir(), log=log)
    net = Model(flash, n_threads=threads, n_ctx=n_ctx, ffn=ffn, weights=weights, kv_dtype="f16",
                head=head)
    return _Parts(flash, tok, ids, net, ffn, weights, head, drafting,
                  plan.draft_rows if plan is not None else 0)


def _report(stats, parts: _Parts, flash_stats: bool, as_json: bool, no_timings: bool) -> None:
    """A one-shot run's timings on stderr: the llama.cpp-style lines, or one JSON object (with
    the flash counters under --stats)."""
    flash_json = _flash_json(parts.ffn, parts.weights, parts.head) if flash_stats else None
    if as_json:
        err.print(_stats_json(stats, flash_json), markup=False, soft_wrap=True, highlight=False)
    elif not no_timings:
        err.print(stats.summary(), markup=False, soft_wrap=True)


def _print_flash_stats(ffn, weights, head) -> None:
    """The --stats table (stderr): the FFN's per-token reads, the streamed dense weights."""
    from flashllm.runtime.stats import stats_table
    err.print(stats_table(ffn.stats()) if ffn is not None else "ffn: dense (no flash I/O)",
              markup=False, soft_wrap=True, highlight=False)
    if weights is not None:
        d = weights.stats()
        err.print(f"dense weights: {len(d['dense_streamed'])} matrices streamed, "
                  f"{d['dense_bytes_read'] / 2**20:.1f} MiB read", markup=False, highlight=False)
    if head is not None:
        h = head.stats()
        n = max(1, h["head_tokens"])
        err.print(f"sparse head: {h['head_rows'] / n:.0f} rows ({h['head_pages'] * 4 / n:.0f} KiB) "
                  f"read a token, {h['head_fallbacks']} of {h['head_tokens']} read the whole "
                  f"head; sketch {h['head_sketch_s'] * 1e3 / n:.1f} ms, rows "
                  f"{h['head_exact_s'] * 1e3 / n:.1f} ms a token", markup=False, highlight=False)


def _flash_json(ffn, weights, head=None) -> dict:
    """The --stats --json "flash" section: the FFN's counters, the streamed dense weights' and the
    sparse head's."""
    d = ffn.stats() if ffn is not None else {"ffn": "dense"}
    if weights is not None:
        d = {**d, "dense": {**weights.stats(), **(head.stats() if head is not None else {})}}
    return d


def _prompt_ids(tok, text: str, n_predict: int, ctx_size: int,
                positions: Optional[int]) -> list[int]:
    """The prompt's ids, which with n_predict more fit --ctx-size and the model's positions
    (learned position embeddings: config.max_positions; None: no such limit)."""
    ids = tok.encode(text, add_special=True)
    if not ids:
        fail("the prompt is empty (no tokens to start from)")
    if positions is not None and positions < ctx_size and len(ids) + n_predict > positions:
        fail(f"prompt ({len(ids)} tokens) + --n-predict {n_predict} exceed the model's "
             f"{positions} positions (learned position embeddings)")
    if len(ids) + n_predict > ctx_size:
        fail(f"prompt ({len(ids)} tokens) + --n-predict {n_predict} exceed --ctx-size {ctx_size}")
    return ids


def _drafter(net, sampler, drafting: _Drafting, p_min: float, head_rows: int):
    """The --draft guesser: None (off), prompt lookup, or the resident model (self)."""
    from flashllm.generation.speculate import NgramDraft
    if not drafting.n:
        return None
    if drafting.kind == "lookup":
        return NgramDraft(drafting.n)
    from flashllm.generation.self_draft import SelfDraft
    from flashllm.runtime.resident import resident_model
    return SelfDraft(resident_model(net, head_rows), sampler, drafting.n, p_min)


def _auto_self_draft(path, flash, fopts, plan, n_ctx: int, process: int, rows: int):
    """(options, plan, on) of a run without --draft under a budget: the plan with a self draft's
    head rows when the draft is expected to pay (assemble.drafts_by_default) and the plan with
    its rows still does (they fit, and leave every attention layer and some neurons in DRAM),
    else the plain plan, undrafted."""
    import dataclasses
    from flashllm.runtime.assemble import drafts_by_default, plan_run
    from flashllm.runtime.budget import BudgetError
    if not drafts_by_default(flash, fopts, plan):
        return fopts, plan, False
    drafted = dataclasses.replace(fopts, draft_rows=rows)
    try:
        with_rows = plan_run(path, drafted, n_ctx, process)
    except BudgetError:                  # the head rows do not fit: plain decoding
        return fopts, plan, False
    if not drafts_by_default(flash, drafted, with_rows):   # they pushed attention out of DRAM
        return fopts, plan, False
    return drafted, with_rows, True


def _complete(net, tok, sampler, ids: list[int], n_predict: int, draft=None):
    """One-shot generation: tokens to stdout, flushed one by one; the GenStats."""
    from flashllm.generation.generate import generate
    detok = tok.detokenizer()
    out = sys.stdout

    def emit(token: int) -> None:
        out.write(detok.push(token))
        out.flush()

    stats = generate(net, sampler, ids, n_predict, stop_ids=tok.eos_ids, on_token=emit,
                     draft=draft, on_prefill=eta_progress(f"prefill of {len(ids)} tokens"))
    out.write(detok.flush() + "\n")
    out.flush()
    return stats


def _load_code() -> None:
    """Import the code a run loads once it has started (the FFN strategies, generation, numpy's
    random and masked arrays: ~4.5 MiB), so the process size a --dram-budget plan measures
    already holds it."""
    import numpy.ma  # noqa: F401
    import numpy.random  # noqa: F401
    import flashllm.generation.generate  # noqa: F401
    import flashllm.runtime.sparse_ffn  # noqa: F401


def _releases_tokenizer(path: Path) -> bool:
    """Whether the model's tokenizer decodes through a byte table, so a one-shot run can release
    it after the prompt (a budget then counts it small): read from tokenizer.json's decoder
    before anything loads."""
    from flashllm.format.layout import TOKENIZER_FILE
    from flashllm.generation.tokenizer import decodes_through_table
    return decodes_through_table(path / TOKENIZER_FILE)


def _chat(flash, net, tok, sampler, system: Optional[str], template_file: Optional[Path],
          n_predict: int, as_json: bool, draft=None) -> None:
    """The interactive chat of `run -i`: answers on stdout, everything else on stderr."""
    import json
    from flashllm.generation.chat import ChatSession, Interrupt, ReplIO, line_editing, repl
    from flashllm.generation.chat_template import load_template
    override = None
    if template_file is not None:
        try:
            override = template_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            fail(f"cannot read chat template {template_file}: {e}")
    cfg = flash.config
    bos = tok.hf.id_to_token(cfg.bos_token_id) if cfg.bos_token_id is not None else None
    eos = tok.hf.id_to_token(cfg.eos_token_ids[0]) if cfg.eos_token_ids else None
    template, origin = load_template(flash.chat_template, override, bos or "", eos or "",
                                     cfg.arch)
    session = ChatSession(net, tok, sampler, template, system=system, n_predict=n_predict,
                          draft=draft)
    tty = sys.stdin.isatty()
    color = tty and sys.stdout.isatty() and not os.environ.get("NO_COLOR") \
        and os.environ.get("TERM") != "dumb"

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    io = ReplIO(read=read_tty if tty else read_line, write=write,
                note=lambda m: err.print(m, markup=False, soft_wrap=True), color=color)
    err.print(f"chat template: {origin}; context {net.n_ctx} tokens", markup=False)
    with line_editing(cache_dir() / "chat_history" if tty else None):
        repl(session, io, Interrupt())
    if as_json:
        err.print(json.dumps({"turns": [t.to_dict() for t in session.turns]}), markup=False,
                  soft_wrap=True, highlight=False)
    if session.n_failed:
        fail(f"{session.n_failed} message(s) were not answered (the errors above)")


def _stats_json(stats, flash: Optional[dict] = None) -> str:
    """One JSON object of a generation's counts, times and speeds (and the flash FFN's
    per-token stats under "flash" with --stats)."""
    import dataclasses
    import json
    extra = {} if flash is None else {"flash": flash}
    return json.dumps({**dataclasses.asdict(stats), "prefill_tps": stats.prefill_tps,
                       "decode_tps": stats.decode_tps, **extra})
