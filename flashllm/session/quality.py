"""`perplexity` and `calibrate`'s work on a converted folder, for the CLI to print."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from flashllm.errors import FlashError

Log = Callable[[str], None]


def quality_text(file: Optional[Path], split: str, kind: str, max_chars: Optional[int] = None):
    """The text for perplexity: FILE, else the shipped text of `split`."""
    from flashllm.sparsity.corpus import builtin_text, file_text
    return file_text(file) if file is not None else builtin_text(split, kind, max_chars)


def perplexity(path: Path, file: Optional[Path], ctx: int, chunks: Optional[int],
               sparsity: Optional[float], corpus: str, threads: int, log: Log, on_chunk,
               progress=None):
    """(llama.cpp's perplexity of the model at path on FILE or the shipped evaluation text,
    dense or with the thresholds of `sparsity`, the text's description); on_chunk(i, n, ppl);
    progress(tokens done, tokens of all chunks) from before the first pass (perplexity's).
    The text and the context are checked before a model of that context is made."""
    from flashllm.format.reader import open_flash
    from flashllm.sparsity.calibrate import text_tokens, thresholds_for
    from flashllm.session.calibration import CALIBRATION_TOKENS, calibration_ids
    from flashllm.runtime.plan import check_context_memory
    from flashllm.runtime.ffn import DenseFfn
    from flashllm.runtime.model import Model
    from flashllm.generation.perplexity import bos_to_add, count_chunks, perplexity as measure
    from flashllm.generation.tokenizer import Tokenizer
    flash = open_flash(path)
    positions = flash.config.max_positions
    if positions is not None and ctx > positions:
        raise FlashError(f"--ctx {ctx} is more than the model's {positions} positions (learned "
                         f"position embeddings): give --ctx {positions} or less")
    check_context_memory(flash.config, ctx)
    tok = Tokenizer.from_flash(flash)
    text = quality_text(file, "evaluation", corpus)
    ids = text_tokens(tok, text.text)
    n = count_chunks(len(ids), ctx, chunks)
    log(f"perplexity of {n} chunks of {ctx} tokens ({len(ids)} tokens in the text)")
    ffn = None
    if sparsity is not None:
        cal = lambda: calibration_ids(tok, None, corpus, CALIBRATION_TOKENS)[1]  # noqa: E731
        dense = lambda: Model(flash, n_threads=threads, n_ctx=ctx)             # noqa: E731
        ffn = DenseFfn(flash, threads, threshold=thresholds_for(flash, sparsity, cal, dense, ctx,
                                                                threads, log))
    net = Model(flash, n_threads=threads, n_ctx=ctx, ffn=ffn, kv_dtype="f16")   # as `run`
    bos = bos_to_add(tok, flash.config.bos_token_id)
    result = measure(net, ids, ctx, chunks, bos, on_chunk=on_chunk, progress=progress)
    return result, text.description


def calibrate(path: Path, opts, budget, log: Log, progress) -> str:
    """Calibrate the converted folder at path (session/calibration.py calibrate_folder with
    opts: CalibrationOptions) within budget (a runtime/budget.Budget; None: no bound), one
    calibration of the folder at a time (sparsity/attempt.hold: a second waits, saying so);
    progress(what, done, of) for each stage; its closing line."""
    import dataclasses
    from flashllm.format.manifest import read_manifest
    from flashllm.runtime.budget import model_bytes
    from flashllm.session.calibration import calibrate_folder, summary
    from flashllm.sparsity.attempt import clear_failure, hold
    if budget is not None:
        opts = dataclasses.replace(opts, dram_budget=budget.bytes_of(model_bytes(read_manifest(path))))
    with hold(path, log):
        section, n = calibrate_folder(path, opts, log, progress)
        clear_failure(path)
    return summary(path, section, n)
