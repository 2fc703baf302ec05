"""A converted folder calibrated as `flashllm calibrate` does it: the calibration text's first
tokens, the dense model over them, what a sparse output head would read, then
sparsity/calibrate.calibrate_model's thresholds, hot-first rewrite and predictor. Called by the
`calibrate` command with the user's options (cli/quality.py), and with the defaults by `run NAME
--dram-budget` on a models.toml model's own conversion, once (calibrate_once: in a child process
outside the budget, under the conversion's lock).
"""
from __future__ import annotations   # light imports: the CLI loads this before any model

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from flashllm.sparsity.corpus import builtin_text, file_text

Log = Callable[[str], None]

MAX_PPL_COST = 0.02         # sparsity/quality.py's bound, calibrate's default
CALIBRATION_TOKENS = 2048   # calibrate's default, and what perplexity --sparsity calibrates on
HEAD_POSITIONS = 256        # calibration positions a sparse head's reads are measured on
CHARS_PER_TOKEN = 8         # the shipped text is read this far a token first, then 4x more


@dataclass(frozen=True)
class CalibrationOptions:
    """What `flashllm calibrate` takes; the defaults are its own."""

    text: Optional[Path] = None      # a calibration text file; None: the shipped corpus
    corpus: str = "code"             # the shipped corpus: code or prose
    sparsity: float = 0.5            # target fraction of inactive FFN neurons
    tokens: int = CALIBRATION_TOKENS
    ctx: int = 512                   # tokens a pass
    criterion: Optional[str] = None  # None: the model's default (sparsity/activations.py)
    reorder: bool = True             # rewrite the FFN hot-first
    predictor: str = "default"       # a kind of sparsity/train.py, "default" or "none"
    threads: int = 2
    max_cost: Optional[float] = MAX_PPL_COST  # perplexity the thresholds may cost (None: no check)


def is_calibrated(manifest: dict) -> bool:
    """Whether a budgeted run finds what calibrate writes: a dense FFN's hot-first order and a
    target checked against perplexity (a conversion calibrated before that check is not; a
    mixture of experts needs neither: its router names the neurons)."""
    return bool(manifest["config"].get("n_experts")) or (
        manifest["ffn"].get("neuron_order") is not None and
        "quality" in (manifest.get("sparsity") or {}))


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
    from flashllm.format.files import update_manifest
    from flashllm.format.reader import open_flash
    from flashllm.generation.tokenizer import Tokenizer
    from flashllm.runtime.layer_pass import LayerPass
    from flashllm.sparsity.calibrate import calibrate_model
    from flashllm.sparsity.train import DEFAULT_KIND
    flash = open_flash(path)
    predictor = opts.predictor
    if predictor == "default":
        predictor = DEFAULT_KIND["glu" if flash.config.glu else "plain"]
    source, ids = calibration_ids(Tokenizer.from_flash(flash), opts.text, opts.corpus,
                                  opts.tokens)
    ctx = opts.ctx
    if flash.config.max_positions is not None and ctx > flash.config.max_positions:
        ctx = flash.config.max_positions
        log(f"passes of {ctx} tokens: the model's learned positions end there")
    net = LayerPass(flash, opts.threads, ctx)
    head: list = []
    final = lambda x: head.append(head_reads(flash, net, x[:min(HEAD_POSITIONS, ctx)],
                                             opts.threads, log))          # noqa: E731
    try:
        section = calibrate_model(flash, net, ids, source.description, opts.sparsity,
                                  opts.criterion, reorder=opts.reorder, n_threads=opts.threads,
                                  log=log, predictor=None if predictor == "none" else predictor,
                                  max_cost=opts.max_cost, on_final=final,
                                  **({"progress": progress} if progress else {}))
    finally:
        net.close()
    if head and head[0]:
        section = {**section, "head": head[0]}
        update_manifest(flash.path, sparsity=section)
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
    asked = f" (asked {q['requested']}: {q['ppl_cost']:+.1%} perplexity at most " \
        f"{q['bound']:.0%})" if "bound" in q and q["requested"] != section["target"] else ""
    return (f"calibrated {path}: {section['criterion']} target {section['target']}{asked}, sparsity "
            f"{sum(section['achieved']) / len(shares):.3f} on {n_tokens} tokens, hottest 20% "
            f"carry {sum(shares) / len(shares):.2f} of activations, "
            + (f"hot-first by {section['order_by']}" if section["hot_first"] else "order kept"))


def calibrate_once(out: Path, log: Log) -> bool:
    """Calibrate a models.toml model's own conversion at out (convert/resolve.resolve_model's)
    with calibrate's defaults, in a child process (its memory outside a run's budget), unless
    it is calibrated (or another process did it while this one waited): True when this call
    calibrated it. A calibration that fails is said and the run goes on without it (as an
    uncalibrated model runs: its plan says what calibrating would change). A folder the user
    gave is theirs: never pass it here."""
    from flashllm.convert.resolve import in_child, locked
    from flashllm.errors import FlashError
    if _calibrated(out):
        return False
    with locked(out.parent / f".{out.name}.lock"):
        if _calibrated(out):
            return False
        log(f"calibrating {out} once for runs under a DRAM budget (the most active "
            "neurons first, what a sparse output head reads; a minute or two on a 1.5B model, "
            "in a child process outside the budget)")
        try:
            in_child(_calibrate_work, (str(out),), f"calibrating {out.name}")
        except FlashError as e:
            log(f"{e}; running {out.name} uncalibrated")
            return False
    return True


def _calibrated(out: Path) -> bool:
    """Whether the conversion at out holds what calibrate writes (an unreadable manifest:
    True, left to the reader to report)."""
    from flashllm.runtime.budget import BudgetError, read_manifest
    try:
        return is_calibrated(read_manifest(out))
    except (BudgetError, KeyError, TypeError):
        return True


def _calibrate_work(out: str, log: Log) -> None:
    """calibrate's defaults in in_child, saying only its closing line (not one a layer)."""
    section, n = calibrate_folder(Path(out))
    log(summary(Path(out), section, n))
