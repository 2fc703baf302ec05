"""`flashllm run`: one-shot completion, pipelines and chat (commands registered on cli.app).

Generated tokens go alone to stdout; timings, stats and errors to stderr.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from flashllm.session.options import (AUTO_DRAFT, DRAFT_KINDS, MAX_DRAFT, PREDICTOR_MODES,
                                      parse_budget)
from flashllm.session.structured import CUT_NOTE
from flashllm.cli.app import (finite, MODEL_HELP, DEFAULT_THREADS, MAX_THREADS, cache_dir, choice,
                              command, err, fail, model_path)
from flashllm.cli.progress import eta_progress
from flashllm.cli.prompt_io import line_reader, read_prompt, read_tty

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
    temp: float = typer.Option(0.8, "--temp", min=0.0, callback=finite, help="Temperature; 0 is greedy."),
    top_k: int = typer.Option(40, "--top-k", min=0, help="Keep the k most likely tokens; 0 disables."),
    top_p: float = typer.Option(0.95, "--top-p", min=0.0, max=1.0, callback=finite, help="Nucleus sampling mass; 1 disables."),
    min_p: float = typer.Option(0.05, "--min-p", min=0.0, max=1.0, callback=finite, help="Drop tokens below min_p × the top probability."),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty", min=0.0, callback=finite, help="Penalty on recent tokens; 1 disables."),
    repeat_last_n: int = typer.Option(64, "--repeat-last-n", min=0, help="How many recent tokens the penalty sees."),
    seed: Optional[int] = typer.Option(None, "--seed", min=-1,
                                       help="Random seed (default, or -1 as in llama.cpp: random)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Never end on an end-of-generation "
                                    "token: it is never drawn (its logit -inf, as llama.cpp's "
                                    "--ignore-eos); a one-shot run makes -n tokens unless the "
                                    "context fills first."),
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
    draft: Optional[int] = typer.Option(None, "--draft", min=0, max=MAX_DRAFT, help="Speculative "
                                        "decoding: check up to N guessed tokens in each pass (as "
                                        "many as pay, learned while running; 0: off). Tokens are drawn "
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
    draft_p_min: float = typer.Option(0.5, "--draft-p-min", min=0.0, max=1.0, callback=finite, help="--draft-kind "
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
    json_schema: Optional[str] = typer.Option(None, "-j", "--json-schema", help="Constrain the "
                                              "output (each answer in a chat) to JSON valid "
                                              "under this JSON schema (text)."),
    json_schema_file: Optional[Path] = typer.Option(None, "--json-schema-file", help="As "
                                                    "--json-schema, the schema read from FILE."),
    grammar_file: Optional[Path] = typer.Option(None, "--grammar-file", help="Constrain the "
                                                "output to a GBNF grammar (llama.cpp's format) "
                                                "read from FILE."),
) -> None:
    """Generate text from a prompt (tokens stream to stdout as they are made), or chat (-i)."""
    from flashllm.session.run import Drafting, FlashAsked, assemble, request
    from flashllm.session.stream import Sampling
    from flashllm.session.structured import output_format

    if interactive and (prompt is not None or file is not None):
        fail("give a prompt (-p/-f) or -i/--chat, not both")
    if not interactive and (system is not None or chat_template is not None):
        fail("-sys/--system and --chat-template are for a chat: give -i/--chat (a one-shot "
             "prompt is completed as it is)")
    fmt = output_format(json_schema, json_schema_file, grammar_file)
    grammar = fmt.compile() if fmt is not None else None     # before the model loads
    budget = parse_budget(dram_budget) if dram_budget is not None else None   # one line if bad
    drafting = Drafting.asked(draft, draft_kind and draft_kind.value, dram_budget is not None,
                              auto=not (naive or dense or interactive))
    if n_predict is None:        # a chat answer may run long; 0 there means a quarter of n_ctx
        n_predict = 0 if interactive else 128
    text = None if interactive else read_prompt(prompt, file, ctx_size)
    path = model_path(model, apart=dram_budget is not None)
    calibrate = "" if Path(model).is_dir() or naive or dense else model   # ours: a name's, a .gguf's
    sampling = Sampling(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n,
                        None if seed == -1 else seed, ignore_eos)
    asked = FlashAsked(budget, window, naive, dense, check_recall, predictor.value,
                       sparse_head, draft_head_rows)
    req = request(path, asked, sampling, drafting, threads, ctx_size,
                  None if interactive else (text, n_predict), calibrate,
                  constrained=grammar is not None)
    parts = assemble(req, cache_dir(), lambda m: err.print(m, markup=False, soft_wrap=True))
    try:
        sampler, guesser = _stream(parts, sampling, grammar, draft_p_min, budget is not None)
        if interactive:
            _chat(parts, sampler, system, chat_template, n_predict, as_json, guesser)
        else:
            stats = _complete(parts, sampler, n_predict, guesser)
            if grammar is not None and not sampler.accepting():
                err.print(CUT_NOTE, markup=False, soft_wrap=True)
            _report(stats, parts, flash_stats, as_json, no_timings,
                    _grammar_json(sampler, guesser) if grammar is not None else None)
        if flash_stats and not as_json:
            _print_flash_stats(parts)
    finally:                      # stop the read-ahead before the buffers go away
        parts.close()


def _stream(parts, sampling, grammar: Optional[str], p_min: float, lean: bool):
    """The run's sampler and drafter: constrained by the compiled grammar when there is one
    (its forced tokens drafted, the drafter's guesses kept to what it allows; lean: its token
    table in less memory, under a budget)."""
    from flashllm.session.run import drafter
    from flashllm.session.structured import constrained, grammar_draft, token_env_of
    if grammar is None:
        sampler = sampling.sampler(parts.tok.eos_ids)
        return sampler, drafter(parts.net, sampler, parts.drafting, p_min, parts.head_rows)
    env = token_env_of(parts.tok, parts.flash, lean)
    sampler = constrained(sampling.params(parts.tok.eos_ids), env, grammar)
    inner = drafter(parts.net, sampler, parts.drafting, p_min, parts.head_rows)
    return sampler, grammar_draft(sampler, inner)


def _grammar_json(sampler, draft) -> dict:
    """--json's "grammar" section: the masks' seconds, the forced tokens drafted, whether the
    output is a whole sentence of the grammar."""
    return {"mask_s": sampler.mask_s, "forced": draft.n_forced, "complete": sampler.accepting()}


def _report(stats, parts, flash_stats: bool, as_json: bool, no_timings: bool,
            grammar: Optional[dict] = None) -> None:
    """A one-shot run's timings on stderr: the llama.cpp-style lines, or one JSON object (with
    the flash counters under --stats, a grammar's under "grammar")."""
    from flashllm.session.stream import flash_json, stats_json
    if as_json:
        err.print(stats_json(stats, flash_json(parts) if flash_stats else None, grammar),
                  markup=False, soft_wrap=True, highlight=False)
    elif not no_timings:
        err.print(stats.summary(), markup=False, soft_wrap=True)


def _print_flash_stats(parts) -> None:
    """The --stats table (stderr): the FFN's per-token reads, the streamed dense weights."""
    from flashllm.session.stream import flash_stats_lines
    lines = flash_stats_lines(parts)
    err.print(lines[0], markup=False, soft_wrap=True, highlight=False)
    for line in lines[1:]:
        err.print(line, markup=False, highlight=False)


def _complete(parts, sampler, n_predict: int, draft=None):
    """One-shot generation: tokens to stdout, flushed one by one; the GenStats."""
    from flashllm.session.stream import complete
    out = sys.stdout

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    stats = complete(parts, sampler, n_predict, draft, write,
                     on_prefill=eta_progress(f"prefill of {len(parts.ids)} tokens"))
    if out.isatty():            # the shell's prompt on a line of its own; a pipe gets the tokens alone
        write("\n")
    return stats


def _chat(parts, sampler, system: Optional[str], template_file: Optional[Path],
          n_predict: int, as_json: bool, draft=None) -> None:
    """The interactive chat of `run -i`: answers on stdout, everything else on stderr."""
    from flashllm.session.stream import chat_loop, chat_session, read_template, turns_json
    override = read_template(template_file) if template_file is not None else None
    session, origin = chat_session(parts, sampler, system, override, n_predict, draft)
    tty = sys.stdin.isatty()
    color = tty and sys.stdout.isatty() and not os.environ.get("NO_COLOR") \
        and os.environ.get("TERM") != "dumb"

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    err.print(f"chat template: {origin}; context {parts.net.n_ctx} tokens", markup=False)
    chat_loop(session, read_tty if tty else line_reader(parts.net.n_ctx), write,
              lambda m: err.print(m, markup=False, soft_wrap=True), color,
              cache_dir() / "chat_history" if tty else None)
    if as_json:
        err.print(turns_json(session), markup=False, soft_wrap=True, highlight=False)
    if session.n_failed:
        fail(f"{session.n_failed} message(s) were not answered (the errors above)")
