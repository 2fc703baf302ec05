"""Calibration: run the dense model over calibration tokens, then thresholds, frequencies, the
hot-first rewrite and a trained predictor, written into the model folder.

calibrate_model is handed the model made to run layer by layer (runtime/layer_pass.LayerPass):
each layer's FFN inputs of all tokens reach sparsity/layer_stats.LayerStats (and, for the
predictor, an on-disk InputStore) before the next layer runs, so the memory is one layer's
(docs/PREDICTOR.md, "Calibrating in bounded memory"). The activation math is in
flashllm.sparsity.activations. collect_ffn_inputs / target_statistics (every layer's inputs in
DRAM, through a token-major Model) serve `perplexity --sparsity` and the studies.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Optional, Sequence

import numpy as np

from flashllm.format.manifest import parse_manifest
from flashllm.format.reader import FlashModel, open_flash
from flashllm.sparsity import cost
from flashllm.units import format_size
from flashllm.sparsity.activations import (CalibrationError, check_criterion, contribution,
                                           default_criterion, down_norms, ffn_activations,
                                           ffn_weights, frequencies, hot_share, threshold)
from flashllm.sparsity.predictor import write_predictor
from flashllm.sparsity.layer_stats import InputStore, LastLayer, LayerStats, layer_scores
from flashllm.sparsity.quality import check_spans, keep_quality, quality_steps
from flashllm.format.files import switch
from flashllm.sparsity.reorder import sweep_temporaries, write_frequency, write_hot_first
from flashllm.sparsity.train import DEFAULT_OPTIONS, train_predictor

class RecordingFfn:
    """An FFN strategy that hands each layer's input h (T, d_model) to on_input(layer, h),
    then lets the wrapped strategy compute the FFN as usual."""

    def __init__(self, inner, on_input: Callable[[int, np.ndarray], None]):
        self.inner = inner
        self.on_input = on_input

    def start_pass(self, n_tokens: int, prefill: bool, pos0: int = 0) -> None:
        self.inner.start_pass(n_tokens, prefill, pos0)

    def __call__(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        self.on_input(layer, h)
        self.inner(layer, h, x)

    def stats(self) -> dict:
        return {**self.inner.stats(), "recording": True}


def run_chunks(model, tokens: Sequence[int], n_ctx: int) -> None:
    """Run the model over tokens in chunks of n_ctx, each from an empty context (logits unused)."""
    ids = np.asarray(tokens, dtype=np.int32)                      # (N,)
    step = min(n_ctx, model.n_ctx)
    for start in range(0, len(ids), step):
        model.reset()
        model.forward(ids[start:start + step], 0, last_only=True)


def collect_ffn_inputs(model, tokens: Sequence[int], n_ctx: int = 512,
                       on_input: Optional[Callable[[int, np.ndarray], None]] = None):
    """Run the dense model over tokens (chunks of n_ctx from an empty context) and collect
    every layer's FFN input h.

    model: a Model (its FFN strategy is wrapped for the run, then restored). With on_input, each chunk's h (T, d_model) of each layer
    goes to on_input(layer, h) as it is made (memory stays bounded) and None is returned;
    without it, returns per layer an (N, d_model) f32 array."""
    cfg, n = model.config, len(tokens)
    if n == 0:
        raise CalibrationError("no calibration tokens")
    store = None
    if on_input is None:
        store = [np.empty((n, cfg.d_model), np.float32) for _ in range(cfg.n_layers)]  # (N, d)
        filled = [0] * cfg.n_layers

        def on_input(layer: int, h: np.ndarray) -> None:
            k = filled[layer]
            store[layer][k:k + len(h)] = h
            filled[layer] = k + len(h)

    inner = model.ffn
    model.ffn = RecordingFfn(inner, on_input)
    try:
        run_chunks(model, tokens, n_ctx)
    finally:
        model.ffn = inner
        model.reset()
    return store


def layer_statistics(flash: FlashModel, inputs, sparsity: float, criterion: str, n_threads: int = 1,
                     log: Callable[[str], None] = lambda m: None, contributions: bool = False):
    """Per layer from its FFN inputs (N, d_model): threshold, per-slot frequency, achieved
    sparsity, and (contributions) each slot's E|h| * ||down|| (activations.contribution).
    Returns (thresholds [L], freq (L, n_ff) f64, achieved [L], contribution (L, n_ff) f64 or
    None)."""
    per, contrib = target_statistics(flash, inputs, [sparsity], criterion, n_threads, log,
                                     contributions)
    return (*per[sparsity], contrib)


def target_statistics(flash: FlashModel, inputs, targets: Sequence[float], criterion: str,
                      n_threads: int = 1, log: Callable[[str], None] = lambda m: None,
                      contributions: bool = False):
    """layer_statistics for several targets from the same scores: ({target: (thresholds [L],
    freq (L, n_ff) f64, achieved [L])}, contribution (L, n_ff) f64 or None); the log line of a
    layer is the first target's."""
    check_criterion(flash.config, criterion)
    per = {t: ([], [], []) for t in targets}           # target -> thresholds, freqs, achieved
    contrib = []
    for layer, h in enumerate(inputs):
        bundles = flash.read_ffn_layer(layer)                                       # (n_ff, stride)
        w = ffn_weights(flash, layer, n_threads, bundles)
        scores = ffn_activations(flash, layer, h, criterion, weights=w)            # (N, n_ff)
        for target, (ths, freqs, achieved) in per.items():
            t = 0.0 if criterion == "relu" else threshold(scores, target)
            freq = frequencies(scores, t, criterion)                                # (n_ff,)
            ths.append(t)
            freqs.append(freq)
            achieved.append(1.0 - float(freq.mean()))
        if contributions:     # every criterion but gate scores |h| itself
            mag = ffn_activations(flash, layer, h, "glu_product", weights=w) \
                if criterion == "gate" else scores                                  # (N, n_ff)
            contrib.append(contribution(mag, down_norms(flash, layer, n_threads, bundles)))
        ths, freqs, achieved = per[targets[0]]
        log(f"layer {layer}: threshold {ths[-1]:.4g}, sparsity {achieved[-1]:.3f}, "
            f"hottest 20% carry {hot_share(freqs[-1]):.2f}")
    stats = {t: (ths, np.stack(freqs), achieved) for t, (ths, freqs, achieved) in per.items()}
    return stats, np.stack(contrib) if contributions else None


def order_by(cfg) -> str:
    """What the hot-first rewrite sorts a layer's neurons by, the most important first (the
    caches hold each layer's first slots). A GLU model: each neuron's expected contribution
    E|h| * ||down|| (activations.contribution) — about half its neurons pass the threshold on
    any token, so frequency hardly ranks them, and what the caches hold is chiefly the draft of
    self-speculation (docs/PREDICTOR.md, "Which neurons the draft should hold"). A ReLU model:
    the frequency of being active, what a predictor's cache hits follow."""
    return "contribution" if cfg.glu else "frequency"


Progress = Callable[[str, int, int], None]    # (what, done, of): one step of a long stage done


def calibrate_model(flash: FlashModel, net, tokens: Sequence[int], text: dict, sparsity: float,
                    criterion: Optional[str] = None, reorder: bool = True, n_threads: int = 1,
                    log: Callable[[str], None] = lambda m: None, predictor: Optional[str] = None,
                    max_cost: Optional[float] = None,
                    on_final: Optional[Callable[[np.ndarray], None]] = None,
                    progress: Progress = lambda what, done, of: None,
                    parts: Optional[Sequence[tuple[str, int]]] = None,
                    amend: Callable[[dict], dict] = lambda section: section) -> dict:
    """Calibrate the model folder of `flash` on tokens, run through `net` (a
    runtime/layer_pass.LayerPass over flash: layer by layer, in bounded memory): thresholds for
    the target sparsity — lowered in steps while they cost more than max_cost of perplexity on
    any of the texts the tokens hold (parts: (name, tokens) in order, default one text named by
    its kind; sparsity/quality.py, measured by net on each text's first tokens, check_spans;
    None: the target as asked) —, per-slot frequencies, (reorder) the hot-first FFN rewrite, and
    (predictor: a kind of flashllm.sparsity.train) a trained predictor. on_final gets the final
    hidden states (N, d_model) of the dense pass; amend(section) the sparsity section to write
    (calibrate_folder adds what it measured). Writes and returns the manifest's sparsity
    section, every file before the manifest's one switch (_commit): interrupted, killed or out
    of disk space, the folder is the old one or the new one, never a mix."""
    cfg = flash.config
    if cfg.n_experts:
        raise CalibrationError("calibrate finds the neurons a dense FFN needs; in a mixture of "
                               "experts the router already names them (run it with --dram-budget)")
    criterion = criterion or default_criterion(cfg)
    check_criterion(cfg, criterion)
    if len(tokens) == 0:
        raise CalibrationError("no calibration tokens")
    sweep_temporaries(flash.path)
    by = order_by(cfg)
    steps = quality_steps(sparsity, criterion) if max_cost is not None else []
    stats = LayerStats(flash, steps or [sparsity], criterion, len(tokens), n_threads,
                       reorder and by == "contribution", log)
    store = InputStore(flash.path.parent, cfg.n_layers, len(tokens), cfg.d_model) \
        if predictor else None
    try:
        def on_input(layer: int, h: np.ndarray) -> None:
            stats.add(layer, h)
            if store is not None:
                store.put(layer, h)
        x = net.run(tokens, on_input, on_layer=lambda i: progress("dense pass", i + 1, cfg.n_layers))
        per, contrib = stats.result()
        del stats                                      # its (N, n_ff) scores, before the head's
        if on_final is not None:
            on_final(x)
        del x
        parts = list(parts or [(text.get("kind") or "text", len(tokens))])
        kept = {"requested": sparsity, "target": sparsity}
        if steps:
            kept.update(_checked(net, tokens, per, parts, max_cost, log, progress))
        text = {**text, "parts": [{"text": name, "n_tokens": n} for name, n in parts]}
        sections, stale = _write(flash, tokens, text, criterion, kept, per, reorder, by,
                                 contrib, net.n_ctx)
        if predictor:
            fit = lambda pending, current: fit_predictor(                      # noqa: E731
                pending, store, per[kept["target"]][0], criterion, predictor, n_threads, log,
                progress, current)
        return _commit(flash, sections, stale, fit if predictor else None, reorder, amend)
    except BaseException:                  # a full disk, Ctrl-C: no new file left unnamed
        sweep_temporaries(flash.path)
        raise
    finally:
        if store is not None:
            store.close()


def _commit(flash: FlashModel, sections: dict, stale: list[str], fit, reorder: bool,
            amend: Callable[[dict], dict]) -> dict:
    """The predictor trained on the written files (fit(pending flash, its current file) -> its
    section; None: none, and a rewrite drops the old one, trained in the slots it reorders),
    the sparsity section amended, then the manifest switched to every new file at once
    (format/files.switch): a calibration killed before leaves the old folder. Returns the sparsity
    section written."""
    old = flash.manifest.get("predictor") or {}
    if fit is not None:
        sections["predictor"] = fit(_pending(flash, sections), old.get("file"))
    elif reorder and old:
        sections["predictor"] = {}
    if old.get("file") and old["file"] != sections.get("predictor", old).get("file"):
        stale.append(old["file"])                                 # replaced, or dropped
    sections["sparsity"] = amend(sections["sparsity"])
    switch(flash.path, stale, **sections)
    return sections["sparsity"]


def _pending(flash: FlashModel, sections: dict) -> FlashModel:
    """The model folder as the manifest with these sections will describe it (its new files are
    written, the manifest is not switched yet)."""
    man = flash.manifest
    return open_flash(flash.path, manifest=parse_manifest({**man.to_dict(), **sections}, man.path))


def _checked(net, tokens: Sequence[int], per: dict, parts: list, max_cost: float,
             log: Callable[[str], None], progress: Progress) -> dict:
    """The target kept (quality.keep_quality on each part's first tokens) and what it costs on
    each text checked: {"target", "ppl_cost", "bound", "checked": [{"text", "tokens",
    "ppl_cost"}]}."""
    spans = check_spans(parts)
    kept = keep_quality(per, _quality(net, tokens, spans, progress),
                        [name for name, _, _ in spans], max_cost, log)
    return {**kept, "checked": [{"text": name, "tokens": n, "ppl_cost": kept["checked"][name]}
                                for name, _, n in spans]}


def _quality(net, tokens: Sequence[int], spans: list,
             progress: Progress) -> Callable[[str, list], float]:
    """ppl(name, thresholds) for keep_quality: net's perplexity on the tokens of the text
    `name`, its span (name, first token, tokens) of quality.check_spans."""
    ids = {name: list(tokens[a:a + n]) for name, a, n in spans}
    n_layers = net.config.n_layers

    def ppl(name: str, thresholds: list) -> float:
        what = f"perplexity check on {name}" + (" (dense)" if thresholds is None else "")
        return net.perplexity(ids[name], thresholds,
                              on_layer=lambda i: progress(what, i + 1, n_layers))
    return ppl


def _write(flash, tokens, text: dict, criterion: str, kept: dict, per: dict, reorder: bool,
           by: str, contrib, n_ctx: int) -> tuple[dict, list[str]]:
    """The files of the kept target's sparsity section written (with the hot-first rewrite's),
    the manifest left as it is: (the manifest sections that name them, the files they replace;
    format/files.switch's arguments)."""
    thresholds, freq, achieved = per[kept["target"]]
    ids = np.asarray(tokens, dtype="<i4")                          # (N,)
    section = {"criterion": criterion, "target": kept["target"],
               "quality": {k: v for k, v in kept.items() if k != "target"},
               "thresholds": thresholds, "achieved": achieved,
               "calibration": {"text": text, "n_tokens": len(ids), "n_ctx": n_ctx,
                               "tokens_sha256": hashlib.sha256(ids.tobytes()).hexdigest()},
               "hot_first": False,
               "frequency": {"hot20_share": [hot_share(f) for f in freq],
                             "never_active": [int((f == 0).sum()) for f in freq]}}
    if reorder:   # the caches hold each layer's first slots
        return write_hot_first(flash, freq, {**section, "order_by": by}, key=contrib)
    prev = flash.manifest.get("sparsity", {}).get("order_by")
    if prev and flash.ffn.neuron_order is not None:     # an earlier rewrite's order stays
        section["order_by"] = prev
    old = (flash.manifest.get("sparsity", {}).get("frequency") or {}).get("file")
    section["frequency"].update(write_frequency(flash.path, freq, old))
    return {"sparsity": section}, [old] if old and old != section["frequency"]["file"] else []


def fit_predictor(flash: FlashModel, inputs, thresholds: list, criterion: str, kind: str,
                  n_threads: int, log: Callable[[str], None],
                  progress: Progress = lambda what, done, of: None,
                  current: Optional[str] = None) -> dict:
    """Train a `kind` predictor on the calibration inputs h (per layer (N, d_model): a list or
    an InputStore) against the thresholded masks, in flash's slot order (calibrate's: after the
    hot-first rewrite, before the manifest's switch), at 95% recall, and write it into the
    model folder under the name that is not current (predictor.write_predictor); one layer's
    inputs and activations in DRAM at a time. Returns the manifest's predictor section."""
    n = len(inputs)
    log(f"training a {kind} predictor on {len(inputs[0])} tokens x {n} layers "
        f"(numpy; tens of seconds on a 1B model)")

    def h_of(i: int) -> np.ndarray:
        progress("predictor", i + 1, n)
        return np.asarray(inputs[i], np.float32)                   # (N, d_model)
    hs = LastLayer(n, h_of)
    acts = LastLayer(n, lambda i: layer_scores(flash, i, hs[i], criterion, n_threads))
    pred = train_predictor(flash, hs, acts, kind, thresholds, recall=0.95,
                           n_threads=n_threads, **DEFAULT_OPTIONS.get(kind, {}))
    m = pred.metrics
    log(f"predictor {kind}: held-out recall {np.mean(m['recall']):.3f}, precision "
        f"{np.mean(m['precision']):.3f}, load {np.mean(m['load']):.3f}, "
        f"{pred.nbytes / 2**20:.1f} MiB in DRAM")
    return write_predictor(flash.path, pred, m, current)


def plan_calibration(flash, n_tokens: int, check: bool, predictor: Optional[str],
                     budget: Optional[int], log: Callable[[str], None],
                     parts: Optional[Sequence[tuple[str, int]]] = None,
                     reorder: bool = True) -> Optional[str]:
    """Say how long calibrating flash on n_tokens (parts: the texts they hold, as
    calibrate_model takes them) will take (sparsity/cost.py); refuse a DRAM budget (bytes,
    None: none) it cannot fit in, and a disk without room for its new files (reorder: the
    hot-first FFN file among them); the predictor kind to train ("none": None): none when the
    budget could not hold it or its training (no run under that budget would use it)."""
    cfg = flash.config
    predictor = None if predictor == "none" else predictor
    if budget is not None:
        predictor = _within_budget(flash, n_tokens, predictor, budget, log)
    _check_disk(flash, n_tokens, predictor, reorder)
    checked = sum(n for _, _, n in check_spans(parts or [("text", n_tokens)]))
    t = cost.seconds(cfg, n_tokens, checked, 2 if check else 0, predictor is not None)
    step = cost.seconds(cfg, 0, checked, 1, False)        # one more target tried, at most
    log(f"calibrating on {n_tokens} tokens, layer by layer: about {max(1, round(t / 60))} min"
        + (f" (up to {step / 60:.1f} min more for each step the target is lowered)"
           if check else ""))
    return predictor


def _within_budget(flash, n_tokens: int, predictor: Optional[str], budget: int,
                   log: Callable[[str], None]) -> Optional[str]:
    """CalibrationError when calibrating on n_tokens needs more than budget bytes; the
    predictor kind to train: None when it or its training would not fit."""
    cfg, mib = flash.config, format_size(budget, "MiB")
    need = cost.peak_bytes(flash, n_tokens)
    if need > budget:
        raise CalibrationError(f"calibrating on {n_tokens} tokens needs about "
                               f"{format_size(need, 'MiB', up=True)}, more than the {mib} "
                               "budget: give a larger --dram-budget or fewer --tokens")
    if predictor and cost.predictor_bytes(cfg, predictor) > budget:
        log(f"no {predictor} predictor: its {format_size(cost.predictor_bytes(cfg, predictor))}"
            f" would not fit a run's {mib} budget")
        return None
    if predictor and cost.training_bytes(cfg, predictor, n_tokens) > budget:
        log(f"no {predictor} predictor: training it needs about "
            f"{format_size(cost.training_bytes(cfg, predictor, n_tokens), 'MiB', up=True)}, "
            f"more than the {mib} budget")
        return None
    return predictor


def _check_disk(flash, n_tokens: int, predictor: Optional[str], reorder: bool) -> None:
    """CalibrationError, before any work, when the folder's file system has no room for the
    files calibrating writes beside the old ones until its switch (cost.disk_bytes)."""
    import shutil
    need = cost.disk_bytes(flash, n_tokens, predictor, reorder)
    free = shutil.disk_usage(flash.path).free
    if need > free:
        raise CalibrationError(f"calibrating {flash.path} writes about "
                               f"{format_size(need, 'MiB', up=True)} of new files beside the old "
                               f"ones, and its disk has {format_size(free, 'MiB')} free: free "
                               "some space")


def text_tokens(tok, text: str, n_tokens: Optional[int] = None) -> list[int]:
    """text tokenized with the model's special tokens (BOS when it adds one), cut to n_tokens."""
    ids = tok.encode(text, add_special=True)
    if n_tokens is not None:
        if len(ids) < n_tokens:
            raise CalibrationError(f"the text has {len(ids)} tokens, {n_tokens} were asked for")
        ids = ids[:n_tokens]
    return ids


def thresholds_for(flash: FlashModel, sparsity: float, calibration_tokens: Callable[[], Sequence[int]],
                   make_model: Callable[[], object], n_ctx: int = 512, n_threads: int = 1,
                   log: Callable[[str], None] = lambda m: None) -> list[float]:
    """Per-layer kernel thresholds for a target sparsity: the model's own when it was calibrated
    for that target with a criterion the kernel applies, else computed now (nothing written)
    on calibration_tokens() through make_model() (a dense Model over flash) with the model's
    default criterion."""
    sec = flash.manifest.get("sparsity") or {}
    if sec.get("target") == sparsity and sec.get("criterion") in ("glu_product", "relu", "magnitude"):
        log(f"using the model's calibrated thresholds (target {sparsity}, {sec['criterion']})")
        return [float(t) for t in sec["thresholds"]]
    criterion = default_criterion(flash.config)
    tokens = calibration_tokens()
    log(f"calibrating thresholds for sparsity {sparsity} on {len(tokens)} tokens ({criterion})")
    inputs = collect_ffn_inputs(make_model(), tokens, n_ctx=n_ctx)
    return layer_statistics(flash, inputs, sparsity, criterion, n_threads)[0]
