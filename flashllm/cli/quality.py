"""`flashllm perplexity` and `flashllm calibrate` (commands registered on cli.app)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from flashllm.cli.app import (finite, MODEL_HELP, DEFAULT_THREADS, MAX_THREADS, choice, command, err, fail,
                              model_path)
from flashllm.session.calibration import MAX_PPL_COST
from flashllm.session.options import (CALIBRATION_CORPORA, CALIBRATION_TOKENS, CORPORA, CRITERIA,
                                      PREDICTOR_KINDS)

Corpus = choice("Corpus", CORPORA)
CalibrationCorpus = choice("CalibrationCorpus", CALIBRATION_CORPORA)
Criterion = choice("Criterion", CRITERIA)
PredictorKind = choice("PredictorKind", ("default", "none", *PREDICTOR_KINDS))


def _measuring():
    """perplexity's (on_chunk, progress) on stderr: from the first pass on, the share of the
    tokens done and the time left (cli/progress.eta_progress, its clock started by progress(0,
    n)); after each chunk a line of its own with the running value and the time left."""
    from flashllm.cli.progress import clear_line, eta_progress
    bar, t0 = eta_progress("perplexity, tokens"), [time.perf_counter()]

    def progress(done: int, total: int) -> None:
        if done == 0:
            t0[0] = time.perf_counter()
        bar(done, total)

    def show(i: int, n: int, ppl: float) -> None:
        left = (time.perf_counter() - t0[0]) / i * (n - i)
        clear_line()
        err.print(f"[{i}/{n}] {ppl:.4f}, about {left / 60:.1f} min left" if i < n else
                  f"[{i}/{n}] {ppl:.4f}", markup=False)
    return show, progress


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
    sparsity: Optional[float] = typer.Option(None, "--sparsity", callback=finite, help="Drop FFN terms below the "
                                             "thresholds for this sparsity (0..1)."),
    corpus: Corpus = typer.Option("code", "--corpus", help="Shipped text: code (Python), prose "
                                  "(Python's documentation), english (stories, letters, essays) or "
                                  "literature (public-domain classics)."),
    threads: int = typer.Option(DEFAULT_THREADS, "-t", "--threads", min=1, max=MAX_THREADS,
                               help="Compute threads."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Perplexity by llama.cpp's definition (second half of each chunk), dense or sparse."""
    import json
    from flashllm.session.quality import perplexity as measure
    if sparsity is not None and not 0.0 <= sparsity < 1.0:
        fail(f"--sparsity must be in [0, 1), not {sparsity}")
    if file is not None and file_opt is not None:
        fail("give the text file once: FILE or -f/--file")
    file = file if file is not None else file_opt
    log = lambda m: err.print(m, markup=False, soft_wrap=True)                  # noqa: E731
    result, text = measure(model_path(model), file, ctx, chunks, sparsity, corpus.value, threads,
                           log, *_measuring())
    if as_json:
        print(json.dumps({**result.to_dict(), "sparsity": sparsity, "text": text}))
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
                                        "the shipped texts, --corpus)."),
    sparsity: float = typer.Option(0.5, "--sparsity", callback=finite, help="Target fraction of inactive FFN neurons "
                                   "(lowered while it costs more than --max-ppl-cost)."),
    max_ppl_cost: float = typer.Option(MAX_PPL_COST * 100, "--max-ppl-cost", min=0.0, callback=finite, help="Percent of perplexity on "
                                       "each calibration text the thresholds may cost against the "
                                       "dense model; the target "
                                       "is lowered in steps of 0.1 until they cost no more on any."),
    keep_target: bool = typer.Option(False, "--keep-target", help="Keep --sparsity as given (no "
                                     "perplexity check)."),
    tokens: int = typer.Option(CALIBRATION_TOKENS, "--tokens", min=1, help="Calibration tokens."),
    ctx: int = typer.Option(512, "-c", "--ctx", "--ctx-size", min=1, help="Tokens per pass."),
    corpus: CalibrationCorpus = typer.Option("mix", "--corpus", help="Shipped text: mix (code, "
                                             "prose, english and literature in equal shares, "
                                             "each checked), or one of them."),
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
    from flashllm.session.options import CalibrationOptions, parse_budget
    from flashllm.session.quality import calibrate as calibrate_model
    if not 0.0 <= sparsity < 1.0:
        fail(f"--sparsity must be in [0, 1), not {sparsity}")
    budget = None if dram_budget is None else parse_budget(dram_budget)   # one line if bad
    path = model_path(model)
    opts = CalibrationOptions(text, corpus.value, sparsity, tokens, ctx,
                              criterion.value if criterion is not None else None, reorder,
                              predictor.value, threads,
                              None if keep_target else max_ppl_cost / 100.0)
    log = lambda m: err.print(m, markup=False, soft_wrap=True)
    err.print(calibrate_model(path, opts, budget, log, _stages()), markup=False, soft_wrap=True)
