"""`flashllm perplexity` and `flashllm calibrate` (commands registered on cli.app)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from flashllm.sparsity.activations import CRITERIA
from flashllm.sparsity.corpus import KINDS as CORPORA
from flashllm.sparsity.predictor import KINDS as PREDICTOR_KINDS
from flashllm.cli.app import (DEFAULT_THREADS, MAX_THREADS, choice, command, err, fail,
                              model_path)

Corpus = choice("Corpus", CORPORA)
Criterion = choice("Criterion", CRITERIA)
PredictorKind = choice("PredictorKind", ("default", "none", *PREDICTOR_KINDS))
CALIBRATION_TOKENS = 2048   # calibrate's default, and what perplexity --sparsity calibrates on


def _quality_text(file: Optional[Path], split: str, kind: str, max_chars: Optional[int] = None):
    """The text for perplexity/calibration: FILE, else the shipped text of `split`."""
    from flashllm.sparsity.corpus import builtin_text, file_text
    return file_text(file) if file is not None else builtin_text(split, kind, max_chars)


def _calibration_ids(tok, file: Optional[Path], corpus: str, n_tokens: int):
    """(the calibration text, its first n_tokens ids): FILE, else the shipped text, read at 8
    characters a token and four times more while the tokenizer makes fewer tokens of it (a
    word-level vocabulary makes one of a word) until the shipped text is all read."""
    from flashllm.sparsity.calibrate import text_tokens
    if file is not None:
        source = _quality_text(file, "calibration", corpus)
        return source, text_tokens(tok, source.text, n_tokens)
    chars, seen = 8 * n_tokens, -1
    while True:
        source = _quality_text(None, "calibration", corpus, chars)
        ids = text_tokens(tok, source.text)
        if len(ids) >= n_tokens:
            return source, ids[:n_tokens]
        if len(source.text) == seen:                   # all of it, still short: say so
            return source, text_tokens(tok, source.text, n_tokens)
        chars, seen = 4 * chars, len(source.text)


def _chunk_line(t0: float):
    """on_chunk for perplexity: the running value and the time left, one line per chunk."""
    def show(i: int, n: int, ppl: float) -> None:
        left = (time.perf_counter() - t0) / i * (n - i)
        err.print(f"[{i}/{n}] {ppl:.4f}, about {left / 60:.1f} min left" if i < n else
                  f"[{i}/{n}] {ppl:.4f}", markup=False)
    return show


@command
def perplexity(
    model: str = typer.Argument(..., help="Converted model folder, or a models.toml name."),
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
        cal = lambda: _calibration_ids(tok, None, corpus, CALIBRATION_TOKENS)[1]
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


HEAD_POSITIONS = 256    # calibration positions a sparse head's reads are measured on


@command
def calibrate(
    model: str = typer.Argument(..., help="Converted model folder, or a models.toml name."),
    text: Optional[Path] = typer.Option(None, "-f", "--text", "--file", help="Calibration text file (default: "
                                        "Python standard-library sources)."),
    sparsity: float = typer.Option(0.5, "--sparsity", help="Target fraction of inactive FFN neurons."),
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
) -> None:
    """Per-layer sparsity thresholds, neuron frequencies, hot-first FFN rewrite, predictor."""
    from flashllm.format.reader import open_flash
    from flashllm.runtime.model import Model
    from flashllm.format.files import update_manifest
    from flashllm.sparsity.calibrate import calibrate_model
    from flashllm.sparsity.train import DEFAULT_KIND
    from flashllm.generation.tokenizer import Tokenizer
    if not 0.0 <= sparsity < 1.0:
        fail(f"--sparsity must be in [0, 1), not {sparsity}")
    flash = open_flash(model_path(model))
    predictor, corpus = predictor.value, corpus.value
    criterion = criterion.value if criterion is not None else None
    if predictor == "default":
        predictor = DEFAULT_KIND["glu" if flash.config.glu else "plain"]
    source, ids = _calibration_ids(Tokenizer.from_flash(flash), text, corpus, tokens)
    log = lambda m: err.print(m, markup=False, soft_wrap=True)
    if flash.config.max_positions is not None and ctx > flash.config.max_positions:
        ctx = flash.config.max_positions
        log(f"passes of {ctx} tokens: the model's learned positions end there")
    net = Model(flash, n_threads=threads, n_ctx=ctx)
    head = _head_reads(flash, net, ids[:min(HEAD_POSITIONS, ctx)], threads, log)
    section = calibrate_model(flash, net, ids, source.description, sparsity, criterion, n_ctx=ctx,
                              reorder=reorder, n_threads=threads, log=log,
                              predictor=None if predictor == "none" else predictor)
    if head:
        section = {**section, "head": head}
        update_manifest(flash.path, sparsity=section)
    shares = section["frequency"]["hot20_share"]
    err.print(f"calibrated {flash.path}: {section['criterion']} target {sparsity}, sparsity "
              f"{sum(section['achieved']) / len(shares):.3f} on {len(ids)} tokens, hottest 20% carry "
              f"{sum(shares) / len(shares):.2f} of activations, "
              + (f"hot-first by {section['order_by']}" if section["hot_first"] else "order kept"),
              markup=False, soft_wrap=True)


def _head_reads(flash, net, ids, threads: int, log) -> Optional[dict]:
    """What a sparse output head would read a token on the calibration text (the planner weighs
    it: runtime/sparse_head.sketch_bytes); None without a head sketch. Measured before the
    hot-first rewrite replaces the FFN file the dense model reads."""
    from flashllm.format.layout import SKETCH
    from flashllm.runtime.sparse_head import measure_reads
    from flashllm.sparsity.calibrate import final_hidden
    if not flash.has(SKETCH):
        return None
    x = final_hidden(net, ids)                                           # (n, d_model)
    head = measure_reads(flash, net.w, x, threads)
    g, k = head["greedy"], head["top40"]
    log(f"sparse head, {len(x)} positions: greedy reads {g['rows']:.0f} rows a token "
        f"({g['fallbacks']:.0%} the whole head), top-40 {k['rows']:.0f} ({k['fallbacks']:.0%})")
    return head
