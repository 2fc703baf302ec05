"""The flashllm command line: parse → call → print.

This is the only module that reads the environment; everything below it takes settings as
arguments. A FlashError becomes one line on stderr and exit code 1; usage errors exit with 2.
Generated tokens go alone to stdout; everything else goes to stderr.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from platformdirs import user_cache_dir
from rich.console import Console

from .errors import FlashError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run language models larger than DRAM: FFN neurons stream from flash.")
err = Console(stderr=True, highlight=False)

DTYPES = ("f32", "f16", "q8_0", "q4_0")
DEFAULT_THREADS = min(os.cpu_count() or 1, 8)


def cache_dir() -> Path:
    """The user cache folder (models fetched and converted by name)."""
    return Path(os.environ.get("FLASHLLM_CACHE") or user_cache_dir("flashllm"))


def registry_path() -> Path:
    """models.toml: FLASHLLM_MODELS, else the one shipped at the project root."""
    env = os.environ.get("FLASHLLM_MODELS")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "models.toml"


def command(fn):
    """Register a CLI command: a FlashError becomes one line on stderr and exit code 1; a closed
    stdout (`| head`) ends quietly with exit code 0; Ctrl-C prints one line, exit code 130."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            result = fn(*args, **kwargs)
            sys.stdout.flush()
            return result
        except FlashError as e:
            err.print(f"error: {e}", markup=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except BrokenPipeError:
            _silence_stdout()
            raise typer.Exit(0) from None
        except KeyboardInterrupt:
            err.print("interrupted", markup=False)
            raise typer.Exit(130) from None
        except ImportError as e:
            if "_native" not in str(e):
                raise
            err.print(f"error: the C extension flashllm._native cannot be loaded ({e}): build it with "
                      "`make setup`, or `make native` in a source tree", markup=False, soft_wrap=True)
            raise typer.Exit(1) from None
    return app.command()(wrapper)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def fail(message: str) -> None:
    err.print(f"error: {message}", markup=False, soft_wrap=True)
    raise typer.Exit(1)


def _resolve(model: str) -> Path:
    """MODEL as given on the command line: a converted folder, or a models.toml name."""
    from .registry import resolve_model
    return resolve_model(model, cache_dir(), registry_path(), log=lambda m: err.print(m, markup=False))


@command
def convert(
    src: List[Path] = typer.Argument(..., help="HF checkpoint folder(s) or GGUF file(s)."),
    out: Path = typer.Option(..., "-o", "--out",
                             help="Output model folder (one source) or parent folder (several)."),
    dtype: str = typer.Option("q8_0", "--dtype", help=f"Storage dtype: {', '.join(DTYPES)}."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output."),
    jobs: int = typer.Option(1, "-j", "--jobs", min=1, help="Sources converted at once (worker processes)."),
) -> None:
    """Repack checkpoints into the row-column-bundled flash layout."""
    from .convert import convert_many
    if dtype not in DTYPES:
        err.print(f"error: --dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
        raise typer.Exit(2)
    failures = convert_many(src, out, dtype, force, console=err, jobs=jobs)
    if failures:
        raise typer.Exit(1)


@command
def pull(name: str = typer.Argument(..., help="A model name from models.toml.")) -> None:
    """Fetch a model listed in models.toml into the user cache and verify its checksum."""
    from .registry import load_registry, pull as pull_model
    entry = load_registry(registry_path()).get(name)
    path = pull_model(entry, cache_dir(), log=lambda m: err.print(m, markup=False))
    print(path)  # on stdout, so scripts can use $(flashllm pull NAME)


@command
def models(as_json: bool = typer.Option(False, "--json", help="Print the list as JSON.")) -> None:
    """List models.toml entries and the user cache: sizes, what is fetched and converted."""
    import json
    from .info import catalog, models_table
    from .registry import load_registry
    rows = catalog(load_registry(registry_path()), cache_dir())
    if as_json:
        print(json.dumps(rows, indent=1))
    else:
        Console(highlight=False).print(models_table(rows))


@command
def inspect(
    path: Path = typer.Argument(..., help="A converted model folder."),
    verify: bool = typer.Option(False, "--verify", help="Also check every checksum."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Summarize a converted model: config, dtypes, sizes, calibration state; --verify checksums."""
    import json
    from .bundle import open_flash
    from .info import flash_summary, summary_table
    summary = flash_summary(open_flash(path), verify=verify)
    if as_json:
        print(json.dumps(summary, indent=1))
    else:
        Console(highlight=False).print(summary_table(summary))


@command
def run(
    model: str = typer.Argument(..., help="Converted model folder, or a models.toml name."),
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="Prompt text; '-' reads stdin."),
    file: Optional[Path] = typer.Option(None, "-f", "--file", help="Read the prompt from a file."),
    n_predict: int = typer.Option(128, "-n", "--n-predict", help="Tokens to generate."),
    ctx_size: int = typer.Option(2048, "-c", "--ctx-size", help="Context length (KV cache size)."),
    threads: int = typer.Option(DEFAULT_THREADS, "-t", "--threads", help="Compute threads."),
    temp: float = typer.Option(0.8, "--temp", help="Temperature; 0 is greedy."),
    top_k: int = typer.Option(40, "--top-k", help="Keep the k most likely tokens; 0 disables."),
    top_p: float = typer.Option(0.95, "--top-p", help="Nucleus sampling mass; 1 disables."),
    min_p: float = typer.Option(0.05, "--min-p", help="Drop tokens below min_p × the top probability."),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty", help="Penalty on recent tokens; 1 disables."),
    repeat_last_n: int = typer.Option(64, "--repeat-last-n", help="How many recent tokens the penalty sees."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed (default: random)."),
    no_timings: bool = typer.Option(False, "--no-timings", help="Do not print the timings line."),
    dram_budget: Optional[str] = typer.Option(
        None, "--dram-budget", help="Stream the FFN from flash within this DRAM: 1.5GiB, 560MiB, "
        "or 50% of the converted model (default: everything in DRAM)."),
    window: Optional[int] = typer.Option(
        None, "--window", help="Keep the neurons of the last K tokens cached (default 4; 2 for GLU)."),
    naive: bool = typer.Option(False, "--naive", help="Read every FFN bundle every token (baseline)."),
    dense: bool = typer.Option(False, "--dense", help="Every FFN bundle in DRAM (the default)."),
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
    from .bundle import open_flash
    from .budget import process_rss
    from .integrity import verify_on_first_load
    from .model import Model
    from .runtime import FlashOptions, make_ffn, make_weights, plan_run
    from .sampler import Sampler, SamplerParams
    from .tokenizer import Tokenizer

    if interactive and (prompt is not None or file is not None):
        fail("give a prompt (-p/-f) or -i/--chat, not both")
    text = None if interactive else _read_prompt(prompt, file)
    path = _resolve(model)
    fopts = FlashOptions(dram_budget, window, naive, dense, check_recall)
    plan = plan_run(path, fopts, ctx_size, process_rss())     # refuses before loading anything
    flash = open_flash(path)
    verify_on_first_load(flash)
    tok = Tokenizer.from_flash(flash)
    ids = None if interactive else _prompt_ids(tok, text, n_predict, ctx_size)
    if plan is not None and not interactive:
        tok.release()            # decoding needs only the token -> bytes table
    ffn = make_ffn(flash, fopts, plan, threads, cache_dir(), log=lambda m: err.print(m, markup=False))
    weights = make_weights(flash, plan, threads)
    net = Model(flash, n_threads=threads, n_ctx=ctx_size, ffn=ffn, weights=weights)
    sampler = Sampler(SamplerParams(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                                    repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                                    seed=seed))
    if interactive:
        _chat(flash, net, tok, sampler, system, chat_template, n_predict, as_json)
    else:
        stats = _complete(net, tok, sampler, ids, n_predict)
        flash_json = (ffn.stats() if ffn is not None else {"ffn": "dense"}) if flash_stats else None
        if as_json:
            err.print(_stats_json(stats, flash_json), markup=False, soft_wrap=True, highlight=False)
        elif not no_timings:
            err.print(stats.summary(), markup=False, soft_wrap=True)
    if flash_stats and not as_json:
        from .flash_stats import stats_table
        err.print(stats_table(net.ffn.stats()) if ffn is not None else "ffn: dense (no flash I/O)",
                  markup=False, soft_wrap=True, highlight=False)


def _prompt_ids(tok, text: str, n_predict: int, ctx_size: int) -> list[int]:
    ids = tok.encode(text, add_special=True)
    if not ids:
        fail("the prompt is empty (no tokens to start from)")
    if len(ids) + n_predict > ctx_size:
        fail(f"prompt ({len(ids)} tokens) + --n-predict {n_predict} exceed --ctx-size {ctx_size}")
    return ids


def _complete(net, tok, sampler, ids: list[int], n_predict: int):
    """One-shot generation: tokens to stdout, flushed one by one; the GenStats."""
    from .generate import generate
    detok = tok.detokenizer()
    out = sys.stdout

    def emit(token: int) -> None:
        out.write(detok.push(token))
        out.flush()

    stats = generate(net, sampler, ids, n_predict, stop_ids=tok.eos_ids, on_token=emit)
    out.write(detok.flush() + "\n")
    out.flush()
    return stats


@command
def profile(
    path: Path = typer.Argument(Path("."), help="A folder on the device to measure (a scratch "
                                "file is written there), or an existing file to read."),
    size: str = typer.Option("2GiB", "--size", help="Scratch file size."),
    seconds: float = typer.Option(30.0, "--seconds", help="Total measuring time."),
    as_json: bool = typer.Option(False, "--json", help="Print the profile as JSON."),
) -> None:
    """Measure the device's direct-I/O read throughput and save it for `run` to plan reads."""
    import json
    from rich.console import Console as StdoutConsole
    from .costmodel import CostModel
    from .profile import parse_size, save_profile
    from .profile_view import model_table, profile_table, run_profile, sequential_table, throughput_chart
    if not path.exists():
        fail(f"{path} does not exist")
    result = run_profile(err, path, parse_size(size), seconds)
    saved = save_profile(result, cache_dir())
    if as_json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        out = StdoutConsole(highlight=False)
        for view in (profile_table(result), sequential_table(result), throughput_chart(result),
                     model_table(CostModel.from_profile(result))):
            out.print(view)
    err.print(f"profile saved to {saved}", markup=False)


def _quality_text(file: Optional[Path], split: str, kind: str, max_chars: Optional[int] = None):
    """The text for perplexity/calibration: FILE, else the shipped text of `split`."""
    from .corpus import builtin_text, file_text
    return file_text(file) if file is not None else builtin_text(split, kind, max_chars)


@command
def perplexity(
    model: str = typer.Argument(..., help="Converted model folder, or a models.toml name."),
    file: Optional[Path] = typer.Argument(None, help="Text file (default: the held-out evaluation "
                                          "text from the Python standard library)."),
    ctx: int = typer.Option(512, "--ctx", help="Tokens per chunk (the context of each pass)."),
    chunks: Optional[int] = typer.Option(None, "--chunks", min=1, help="Chunks to score (default: all)."),
    sparsity: Optional[float] = typer.Option(None, "--sparsity", help="Drop FFN terms below the "
                                             "thresholds for this sparsity (0..1)."),
    corpus: str = typer.Option("code", "--corpus", help="Shipped text: code or prose."),
    threads: int = typer.Option(DEFAULT_THREADS, "-t", "--threads", help="Compute threads."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Perplexity by llama.cpp's definition (second half of each chunk), dense or sparse."""
    import json
    from .bundle import open_flash
    from .calibrate import text_tokens, thresholds_for
    from .ffn import DenseFfn
    from .model import Model
    from .perplexity import bos_to_add, perplexity as measure
    from .tokenizer import Tokenizer
    if sparsity is not None and not 0.0 <= sparsity < 1.0:
        fail(f"--sparsity must be in [0, 1), not {sparsity}")
    flash = open_flash(_resolve(model))
    tok = Tokenizer.from_flash(flash)
    text = _quality_text(file, "evaluation", corpus)
    log = lambda m: err.print(m, markup=False, soft_wrap=True)
    ffn = None
    if sparsity is not None:
        cal = lambda: text_tokens(tok, _quality_text(None, "calibration", corpus, 16384).text, 2048)
        ffn = DenseFfn(flash, threads, threshold=thresholds_for(flash, sparsity, cal, ctx, threads, log))
    net = Model(flash, n_threads=threads, n_ctx=ctx, ffn=ffn)
    bos = bos_to_add(tok, flash.config.bos_token_id)
    result = measure(net, text_tokens(tok, text.text), ctx, chunks, bos,
                     on_chunk=lambda i, n, p: err.print(f"[{i}/{n}] {p:.4f}", markup=False))
    if as_json:
        print(json.dumps({**result.to_dict(), "sparsity": sparsity, "text": text.description}))
    else:
        print(result.summary())


@command
def calibrate(
    model: str = typer.Argument(..., help="Converted model folder, or a models.toml name."),
    text: Optional[Path] = typer.Option(None, "--text", help="Calibration text file (default: "
                                        "Python standard-library sources)."),
    sparsity: float = typer.Option(0.5, "--sparsity", help="Target fraction of inactive FFN neurons."),
    tokens: int = typer.Option(2048, "--tokens", min=1, help="Calibration tokens."),
    ctx: int = typer.Option(512, "--ctx", help="Tokens per pass."),
    corpus: str = typer.Option("code", "--corpus", help="Shipped text: code or prose."),
    criterion: Optional[str] = typer.Option(None, "--criterion", help="glu_product (GLU default), "
                                            "gate (CATS), relu, magnitude."),
    reorder: bool = typer.Option(True, "--reorder/--no-reorder", help="Rewrite the FFN hot-first."),
    predictor: str = typer.Option("default", "--predictor", help="Predictor to train: default "
                                  "(gate_up for GLU models, lowrank otherwise), a kind, or none."),
    threads: int = typer.Option(DEFAULT_THREADS, "-t", "--threads", help="Compute threads."),
) -> None:
    """Per-layer sparsity thresholds, neuron frequencies, hot-first FFN rewrite, predictor."""
    from .bundle import open_flash
    from .calibrate import calibrate_model, text_tokens
    from .predictor import KINDS
    from .predictor_train import DEFAULT_KIND
    from .tokenizer import Tokenizer
    if not 0.0 <= sparsity < 1.0:
        fail(f"--sparsity must be in [0, 1), not {sparsity}")
    if predictor not in ("default", "none", *KINDS):
        fail(f"--predictor must be default, none or one of {', '.join(KINDS)}, not {predictor!r}")
    flash = open_flash(_resolve(model))
    if predictor == "default":
        predictor = DEFAULT_KIND["glu" if flash.config.glu else "plain"]
    source = _quality_text(text, "calibration", corpus, None if text else 8 * tokens)
    ids = text_tokens(Tokenizer.from_flash(flash), source.text, tokens)
    log = lambda m: err.print(m, markup=False, soft_wrap=True)
    section = calibrate_model(flash, ids, source.description, sparsity, criterion, n_ctx=ctx,
                              reorder=reorder, n_threads=threads, log=log,
                              predictor=None if predictor == "none" else predictor)
    shares = section["frequency"]["hot20_share"]
    err.print(f"calibrated {flash.path}: {section['criterion']} target {sparsity}, sparsity "
              f"{sum(section['achieved']) / len(shares):.3f} on {len(ids)} tokens, hottest 20% carry "
              f"{sum(shares) / len(shares):.2f} of activations, hot-first {section['hot_first']}",
              markup=False, soft_wrap=True)


def _read_prompt(prompt: Optional[str], file: Optional[Path]) -> str:
    if prompt is not None and file is not None:
        fail("give the prompt with -p or -f, not both")
    if file is not None:
        try:
            return file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            fail(f"cannot read prompt file {file}: {e}")
    if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
        return sys.stdin.read()
    if prompt is None:
        fail("no prompt: give -p TEXT, -f FILE, or pipe text to stdin")
    return prompt


def _chat(flash, net, tok, sampler, system: Optional[str], template_file: Optional[Path],
          n_predict: int, as_json: bool) -> None:
    """The interactive chat of `run -i`: answers on stdout, everything else on stderr."""
    import json
    from .chat import ChatSession, Interrupt, ReplIO, line_editing, repl
    from .chat_template import load_template
    override = None
    if template_file is not None:
        try:
            override = template_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            fail(f"cannot read chat template {template_file}: {e}")
    cfg = flash.config
    bos = tok.hf.id_to_token(cfg.bos_token_id) if cfg.bos_token_id is not None else None
    eos = tok.hf.id_to_token(cfg.eos_token_ids[0]) if cfg.eos_token_ids else None
    template, origin = load_template(flash.chat_template, override, bos or "", eos or "")
    session = ChatSession(net, tok, sampler, template, system=system, n_predict=n_predict)
    tty = sys.stdin.isatty()
    color = tty and sys.stdout.isatty() and not os.environ.get("NO_COLOR") \
        and os.environ.get("TERM") != "dumb"

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    io = ReplIO(read=input if tty else _read_line, write=write,
                note=lambda m: err.print(m, markup=False, soft_wrap=True), color=color)
    err.print(f"chat template: {origin}; context {net.n_ctx} tokens", markup=False)
    with line_editing(cache_dir() / "chat_history" if tty else None):
        repl(session, io, Interrupt())
    if as_json:
        err.print(json.dumps({"turns": [t.to_dict() for t in session.turns]}), markup=False,
                  soft_wrap=True, highlight=False)


def _read_line(prompt: str) -> str:
    """input() for a non-TTY stdin: no prompt echo (stdout carries answers only)."""
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line


def _stats_json(stats, flash: Optional[dict] = None) -> str:
    """One JSON object of a generation's counts, times and speeds (and the flash FFN's
    per-token stats under "flash" with --stats)."""
    import dataclasses
    import json
    extra = {} if flash is None else {"flash": flash}
    return json.dumps({**dataclasses.asdict(stats), "prefill_tps": stats.prefill_tps,
                       "decode_tps": stats.decode_tps, **extra})


def main() -> None:
    """Console entry point: domain errors become one line and exit code 1."""
    try:
        app()
    except FlashError as e:
        err.print(f"error: {e}", markup=False, soft_wrap=True)
        sys.exit(1)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(0)
    except KeyboardInterrupt:
        err.print("interrupted", markup=False)
        sys.exit(130)


if __name__ == "__main__":
    main()
