"""A converted folder calibrated as `flashllm calibrate` does it: the calibration text's first
tokens, the dense model over them, what a sparse output head would read, then
sparsity/calibrate.calibrate_model's thresholds, hot-first rewrite and predictor. Called by the
`calibrate` command with the user's options (session/quality.py), and with the defaults by `run NAME
--dram-budget` on a models.toml model's own conversion, once (calibrate_once: in a child process
outside the budget, under the conversion's lock).
"""
from __future__ import annotations   # light imports: the CLI loads this before any model

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from flashllm.sparsity.corpus import KINDS, MIX, builtin_text, file_text
from flashllm.sparsity.quality import CHECK_VERSION

if TYPE_CHECKING:
    from flashllm.runtime.budget_given import Budget

Log = Callable[[str], None]

MAX_PPL_COST = 0.015        # sparsity/quality.py's bound, calibrate's default: held-out famous
                            # prose costs ~2x what the checked texts do (docs/QUALITY.md)
CALIBRATION_TOKENS = 2048   # calibrate's default, and what perplexity --sparsity calibrates on
HEAD_POSITIONS = 256        # calibration positions a sparse head's reads are measured on
CHARS_PER_TOKEN = 8         # the shipped text is read this far a token first, then 4x more


@dataclass(frozen=True)
class CalibrationOptions:
    """What `flashllm calibrate` takes; the defaults are its own."""

    text: Optional[Path] = None      # a calibration text file; None: the shipped corpus
    corpus: str = MIX                # the shipped corpus: one of corpus.KINDS or their mix
    sparsity: float = 0.5            # target fraction of inactive FFN neurons
    tokens: int = CALIBRATION_TOKENS
    ctx: int = 512                   # tokens a pass
    criterion: Optional[str] = None  # None: the model's default (sparsity/activations.py)
    reorder: bool = True             # rewrite the FFN hot-first
    predictor: str = "default"       # a kind of sparsity/train.py, "default" or "none"
    threads: int = 2
    max_cost: Optional[float] = MAX_PPL_COST  # perplexity the thresholds may cost (None: no check)
    dram_budget: Optional[int] = None  # bytes the calibration may hold (None: no bound)


def is_calibrated(manifest: dict) -> bool:
    """Whether a budgeted run finds what calibrate writes: a dense FFN's hot-first order and a
    target checked against perplexity by the current rule (sparsity/quality.CHECK_VERSION: each
    text of the mix, literature too, against the dense model), or kept as asked (a conversion
    calibrated before that, or checked on its code text alone, is not; a mixture of experts
    needs neither: its router names the neurons)."""
    quality = (manifest.get("sparsity") or {}).get("quality")
    return bool(manifest["config"].get("n_experts")) or (
        manifest["ffn"].get("neuron_order") is not None and quality is not None and
        not checked_by_older_rule(quality))


def checked_by_older_rule(quality: dict) -> bool:
    """Whether a manifest's sparsity.quality was checked against perplexity by a rule before
    sparsity/quality.CHECK_VERSION (False for a target kept as asked)."""
    return "bound" in quality and quality.get("version", 0) < CHECK_VERSION


def calibration_texts(tok, file: Optional[Path], corpus: str, n_tokens: int):
    """(the description of the calibration text, its first n_tokens ids, its parts: (name,
    tokens) of each text in order): FILE or the shipped text of one kind (calibration_ids:
    one part), or for MIX every kind's first tokens, n_tokens split evenly, each part checked
    on its own (sparsity/quality.py)."""
    from flashllm.sparsity.activations import CalibrationError
    if file is not None or corpus != MIX:
        source, ids = calibration_ids(tok, file, corpus, n_tokens)
        return source.description, ids, [(source.description.get("kind") or "text", len(ids))]
    if n_tokens < 4 * len(KINDS):
        raise CalibrationError(f"a mix of {len(KINDS)} texts needs at least {4 * len(KINDS)} "
                               f"tokens, {n_tokens} were asked for")
    texts, ids, parts = [], [], []
    for i, kind in enumerate(KINDS):
        n = n_tokens // len(KINDS) + (i < n_tokens % len(KINDS))
        source, got = calibration_ids(tok, None, kind, n)
        texts.append(source.description)
        ids += got
        parts.append((kind, n))
    return {"source": MIX, "texts": texts}, ids, parts


def calibration_ids(tok, file: Optional[Path], corpus: str, n_tokens: int):
    """(the calibration text, its first n_tokens ids): FILE, else the shipped text, read at
    CHARS_PER_TOKEN characters a token and four times more while the tokenizer makes fewer
    tokens of it (a word-level vocabulary makes one of a word) until it is all read."""
    from flashllm.sparsity.calibrate import text_tokens
    if file is not None:
        source = file_text(file)
        return source, text_tokens(tok, source.text, n_tokens)
    chars, seen = CHARS_PER_TOKEN * n_tokens, -1
    while True:
        source = builtin_text("calibration", corpus, chars)
        ids = text_tokens(tok, source.text)
        if len(ids) >= n_tokens:
            return source, ids[:n_tokens]
        if len(source.text) == seen:                   # all of it, still short: say so
            return source, text_tokens(tok, source.text, n_tokens)
        chars, seen = 4 * chars, len(source.text)


def calibrate_folder(path: Path, opts: CalibrationOptions = CalibrationOptions(),
                     log: Log = lambda m: None, progress=None) -> tuple[dict, int]:
    """Calibrate the converted folder at path: (the manifest's sparsity section written, the
    number of calibration tokens). The model runs layer by layer from its folder
    (runtime/layer_pass.py); progress(what, done, of) after each step of a long stage."""
    from flashllm.ffi.heap import trim_heap
    from flashllm.format.reader import open_flash
    from flashllm.generation.tokenizer import Tokenizer
    from flashllm.runtime.layer_pass import LayerPass
    from flashllm.sparsity.calibrate import calibrate_model, plan_calibration
    from flashllm.sparsity.train import DEFAULT_KIND
    from flashllm.runtime.plan import check_context_memory
    flash = open_flash(path)
    check_context_memory(flash.config, opts.ctx)     # -c 999999999: refused, not made
    predictor = opts.predictor
    if predictor == "default":
        predictor = DEFAULT_KIND["glu" if flash.config.glu else "plain"]
    t0 = time.perf_counter()
    text, ids, parts = calibration_texts(Tokenizer.from_flash(flash), opts.text, opts.corpus,
                                         opts.tokens)
    trim_heap()                                      # the tokenizer's, freed
    ctx = opts.ctx
    if flash.config.max_positions is not None and ctx > flash.config.max_positions:
        ctx = flash.config.max_positions
        log(f"passes of {ctx} tokens: the model's learned positions end there")
    predictor = plan_calibration(flash, len(ids), opts.max_cost is not None, predictor,
                                 opts.dram_budget, log, parts, opts.reorder)
    net = LayerPass(flash, opts.threads, ctx)
    head: list = []
    final = lambda x: head.append(head_reads(flash, net, x[:min(HEAD_POSITIONS, ctx)],
                                             opts.threads, log))          # noqa: E731

    def amend(section: dict) -> dict:             # what this call measured, in the one switch
        section = {**section, **({"head": head[0]} if head and head[0] else {})}
        return {**section, "calibration": {**section["calibration"],
                                           "seconds": round(time.perf_counter() - t0, 1)}}
    try:
        section = calibrate_model(flash, net, ids, text, opts.sparsity,
                                  opts.criterion, reorder=opts.reorder, n_threads=opts.threads,
                                  log=log, predictor=predictor,
                                  max_cost=opts.max_cost, on_final=final, parts=parts,
                                  amend=amend, **({"progress": progress} if progress else {}))
    finally:
        net.close()
    return section, len(ids)


def head_reads(flash, net, x, threads: int, log: Log) -> Optional[dict]:
    """What a sparse output head would read a token on the calibration text (the planner weighs
    it: runtime/sparse_head.sketch_bytes), from the dense pass's final hidden states x (n,
    d_model) of the text's first positions; None without a head sketch."""
    from flashllm.format.layout import SKETCH
    from flashllm.runtime.sparse_head import measure_reads
    if not flash.has(SKETCH):
        return None
    head = measure_reads(flash, net.w, net.head_input(x), threads)
    g, k = head["greedy"], head["top40"]
    log(f"sparse head, {len(x)} positions: greedy reads {g['rows']:.0f} rows a token "
        f"({g['fallbacks']:.0%} the whole head), top-40 {k['rows']:.0f} ({k['fallbacks']:.0%})")
    return head


def summary(path: Path, section: dict, n_tokens: int) -> str:
    """calibrate's closing line."""
    shares = section["frequency"]["hot20_share"]
    q = section.get("quality") or {}
    asked = f" (asked {q['requested']})" if q.get("requested", section["target"]) != \
        section["target"] else ""
    seconds = section["calibration"].get("seconds")
    return (f"calibrated {path}: {section['criterion']} target {section['target']}{asked}"
            + (f", perplexity {checked_words(q)}" if "bound" in q else "") + ", sparsity "
            f"{sum(section['achieved']) / len(shares):.3f} on {n_tokens} tokens, hottest 20% "
            f"carry {sum(shares) / len(shares):.2f} of activations, "
            + (f"hot-first by {section['order_by']}" if section["hot_first"] else "order kept")
            + (f", in {seconds / 60:.1f} min" if seconds is not None else ""))


def checked_words(quality: dict) -> str:
    """'+0.8% on code, +1.9% on english (bound 2%)': what the kept target costs on each text
    checked (the largest alone for a calibration before the texts were checked one by one)."""
    costs = [f"{c['ppl_cost']:+.1%} on {c['text']} ({c['tokens']} tokens)"
             for c in quality.get("checked", [])] or [f"{quality['ppl_cost']:+.1%}"]
    return ", ".join(costs) + f" (bound {quality['bound']:.1%})"


def calibrate_once(out: Path, log: Log, name: str = "", budget: Optional["Budget"] = None) -> bool:
    """Calibrate a models.toml model's (or a GGUF file's) own conversion at out
    (convert/resolve.resolve_model's) with calibrate's defaults within the run's DRAM budget
    (runtime/budget.Budget), in a child process, unless it is calibrated (or another process did
    it while this one waited), or an earlier try failed with no more memory than this one
    (sparsity/attempt.py: then one line says what is missing and how to calibrate by hand):
    True when this call calibrated it. A calibration that fails is said, remembered and the run
    goes on without it (its plan says what calibrating would change). A folder the user gave is
    theirs: never pass it here. name: what the user typed for the model (for the command)."""
    from flashllm.convert.resolve import in_child
    from flashllm.errors import FlashError
    from flashllm.sparsity.attempt import clear_failure, hold, known_failure, record_failure
    from flashllm.sparsity.reorder import sweep_temporaries
    if _calibrated(out):
        return False
    nbytes = _budget_bytes(out, budget)
    by_hand = f"flashllm calibrate {name or out}" + (f" --dram-budget {budget.text}" if budget else "")
    failed = known_failure(out, nbytes)
    if failed is not None:
        log(f"{name or out.name} runs uncalibrated: its calibration failed on {failed['when']} "
            f"({failed['reason']}); calibrate it by hand: {by_hand}")
        return False
    with hold(out, log):
        if _calibrated(out):
            return False
        log(f"calibrating {out} once for runs under a DRAM budget (the most active "
            "neurons first, what a sparse output head reads), in a child process"
            + (f" within {budget.text}" if budget else ""))
        try:
            in_child(_calibrate_work, (str(out), nbytes), f"calibrating {out.name}")
        except FlashError as e:
            sweep_temporaries(out)          # the dead child's files: its folder is the old one
            record_failure(out, str(e), nbytes)
            log(f"{e}; running {out.name} uncalibrated (not tried again; by hand: {by_hand})")
            return False
        clear_failure(out)
    return True


def _budget_bytes(out: Path, budget: Optional["Budget"]) -> Optional[int]:
    """Bytes of a run's --dram-budget for the conversion at out (None: no budget)."""
    from flashllm.format.manifest import read_manifest
    from flashllm.runtime.budget import model_bytes
    if budget is None:
        return None
    return budget.bytes_of(model_bytes(read_manifest(out)))


def _calibrated(out: Path) -> bool:
    """Whether the conversion at out holds what calibrate writes (an unreadable manifest:
    True, left to the reader to report)."""
    from flashllm.errors import FlashError
    from flashllm.format.manifest import read_manifest
    try:
        return is_calibrated(read_manifest(out))
    except (FlashError, KeyError, TypeError):
        return True


def _calibrate_work(out: str, budget: Optional[int], log: Log) -> None:
    """calibrate's defaults in in_child within budget bytes, saying only its closing line (not
    one a layer)."""
    t0 = time.perf_counter()

    def stage(what: str, done: int, of: int) -> None:      # a line a stage, not one a layer
        if done == of:
            log(f"calibrating: {what} done ({time.perf_counter() - t0:.0f} s)")
    said = lambda m: None if m.startswith("layer ") else log(m)      # noqa: E731 (not a layer's)
    section, n = calibrate_folder(Path(out), CalibrationOptions(dram_budget=budget), said, stage)
    log(summary(Path(out), section, n))
