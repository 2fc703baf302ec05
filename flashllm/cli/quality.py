"""`flashllm perplexity` and `flashllm calibrate` (commands registered on cli.app)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from flashllm.sparsity.activations import CRITERIA
from flashllm.sparsity.corpus import KINDS as CORPORA
from flashllm.sparsity.predictor import KINDS as PREDICTOR_KINDS
from flashllm.cli.app import (MODEL_HELP, DEFAULT_THREADS, MAX_THREADS, choice, command, err, fail,
                              model_path)
from flashllm.cli.calibration import CALIBRATION_TOKENS

Corpus = choice("Corpus", CORPORA)
Criterion = choice("Criterion", CRITERIA)
PredictorKind = choice("PredictorKind", ("default", "none", *PREDICTOR_KINDS))


def _quality_text(file: Optional[Path], split: str, kind: str, max_chars: Optional[int] = None):
    """The text for perplexity: FILE, else the shipped text of `split`."""
    from flashllm.sparsity.corpus import builtin_text, file_text
    return file_text(file) if file is not None else builtin_text(split, kind, max_chars)


def _chunk_line(t0: float):
    """on_chunk for perplexity: the running value and the time left, one line per chunk."""
    def show(i: int, n: int, ppl: float) -> None:
        left = (time.perf_counter() - t0) / i * (n - i)
        err.print(f"[{i}/{n}] {ppl:.4f}, about {left / 60:.1f} min left" if i < n else
                  f"[{i}/{n}] {ppl:.4f}", markup=False)
    return show


@command
def perplexity(
    model: str = typer.Argument(..., help=MODEL_HELP),
    file: Optional[Path] = typer.Argument(None, help="Text file (default: the held-out evaluation "
                                          "text from the Python standard library)."),
    file_opt: Optional[Path] = typer.Option(None, "-f", "--file", help="The text file, as llama.cpp "
                                            "names it (instead of FILE)."),
    ctx: int = typer.Option(512, "-c", "--ctx", "--ctx-size", min=2,
                            help="Tokens per chunk (the context of each pass)."),
    chunks: Optional[int] = typer.Option(None, "--chunks", min=1, help="Chunks to score (default: all)."),
    sparsity: Optional[float] = typer.Option(None, "--sparsity", help="Drop FFN terms below the "
                                             "thresholds for this sparsity (0..1)."),
    corpus: Corpus = typer.Option("code", "--corpus", help="Shipped text: code or prose."),
    threads: int = typer.Option(DEFAULT_THREADS, "-t", "--threads", min=1, max=MAX_THREADS,
                               help="Compute threads."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Perplexity by llama.cpp's definition (second half of each chunk), dense or sparse."""
    import json
    from flashllm.format.reader import open_flash
    from flashllm.sparsity.calibrate import text_tokens, thresholds_for
    from flashllm.cli.calibration import calibration_ids
    from flashllm.runtime.ffn import DenseFfn
    from flashllm.runtime.model import Model
    from flashllm.generation.perplexity import bos_to_add, perplexity as measure
    from flashllm.generation.tokenizer import Tokenizer
    if sparsity is not None and not 0.0 <= sparsity < 1.0:
        fail(f"--sparsity must be in [0, 1), not {sparsity}")
    if file is not None and file_opt is not None:
        fail("give the text file once: FILE or -f/--file")
    file = file if file is not None else file_opt
    flash = open_flash(model_path(model))
    positions = flash.config.max_positions
    if positions is not None and ctx > positions:
        fail(f"--ctx {ctx} is more than the model's {positions} positions (learned position "
             f"embeddings): give --ctx {positions} or less")
    tok = Tokenizer.from_flash(flash)
    corpus = corpus.value
    text = _quality_text(file, "evaluation", corpus)
    log = lambda m: err.print(m, markup=False, soft_wrap=True)
    ffn = None
    if sparsity is not None:
        cal = lambda: calibration_ids(tok, None, corpus, CALIBRATION_TOKENS)[1]
        dense = lambda: Model(flash, n_threads=threads, n_ctx=ctx)
        ffn = DenseFfn(flash, threads, threshold=thresholds_for(flash, sparsity, cal, dense, ctx, threads, log))
    net = Model(flash, n_threads=threads, n_ctx=ctx, ffn=ffn, kv_dtype="f16")   # as `run`
    bos = bos_to_add(tok, flash.config.bos_token_id)
    result = measure(net, text_tokens(tok, text.text), ctx, chunks, bos,
                     on_chunk=_chunk_line(time.perf_counter()))
    if as_json:
        print(json.dumps({**result.to_dict(), "sparsity": sparsity, "text": text.description}))
    else:
        print(result.summary())


def _stages():
    """calibrate's progress(what, done, of) on stderr: cli/progress.eta_progress, a new one
    for each stage (a stage's first step is 1)."""
    from flashllm.cli.progress import eta_progress
    shown = [None, None]                          # the stage, its eta_progress

    def progress(what: str, done: int, of: int) -> None:
        if done == 1 or shown[0] != what:
            shown[:] = what, eta_progress(what)
        shown[1](done, of)
    return progress


@command
def calibrate(
    model: str = typer.Argument(..., help=MODEL_HELP),
    text: Optional[Path] = typer.Option(None, "-f", "--text", "--file", help="Calibration text file (default: "
                                        "Python standard-library sources)."),
    sparsity: float = typer.Option(0.5, "--sparsity", help="Target fraction of inactive FFN neurons "
                                   "(lowered while it costs more than --max-ppl-cost)."),
    max_ppl_cost: float = typer.Option(2.0, "--max-ppl-cost", min=0.0, help="Percent of perplexity on "
                                       "the calibration text the thresholds may cost; the target "
                                       "is lowered in steps of 0.1 until they cost no more."),
    keep_target: bool = typer.Option(False, "--keep-target", help="Keep --sparsity as given (no "
                                     "perplexity check)."),
    tokens: int = typer.Option(CALIBRATION_TOKENS, "--tokens", min=1, help="Calibration tokens."),
    ctx: int = typer.Option(512, "-c", "--ctx", "--ctx-size", min=1, help="Tokens per pass."),
    corpus: Corpus = typer.Option("code", "--corpus", help="Shipped text: code or prose."),
    criterion: Optional[Criterion] = typer.Option(None, "--criterion", help="glu_product (GLU default), "
                                            "gate (CATS), relu, magnitude."),
    reorder: bool = typer.Option(True, "--reorder/--no-reorder", help="Rewrite the FFN hot-first."),
    predictor: PredictorKind = typer.Option("default", "--predictor", help="Predictor to train: default "
                                  "(gate_up for GLU models, lowrank otherwise), a kind, or none."),
    threads: int = typer.Option(DEFAULT_THREADS, "-t", "--threads", min=1, max=MAX_THREADS,
                               help="Compute threads."),
    dram_budget: Optional[str] = typer.Option(None, "--dram-budget", help="DRAM the calibration "
                                              "may hold (e.g. 280MiB, 50%): the model is read "
                                              "layer by layer from its folder."),
) -> None:
    """Per-layer sparsity thresholds, neuron frequencies, hot-first FFN rewrite, predictor."""
    from flashllm.cli.calibration import CalibrationOptions, calibrate_folder, summary
    from flashllm.runtime.budget import model_bytes, parse_budget, read_manifest
    from flashllm.sparsity.attempt import clear_failure, hold
    if not 0.0 <= sparsity < 1.0:
        fail(f"--sparsity must be in [0, 1), not {sparsity}")
    path = model_path(model)
    budget = None if dram_budget is None else parse_budget(dram_budget,
                                                           model_bytes(read_manifest(path)))
    opts = CalibrationOptions(text, corpus.value, sparsity, tokens, ctx,
                              criterion.value if criterion is not None else None, reorder,
                              predictor.value, threads,
                              None if keep_target else max_ppl_cost / 100.0, budget)
    log = lambda m: err.print(m, markup=False, soft_wrap=True)
    with hold(path, log):
        section, n = calibrate_folder(path, opts, log, _stages())
        clear_failure(path)
    err.print(summary(path, section, n), markup=False, soft_wrap=True)
