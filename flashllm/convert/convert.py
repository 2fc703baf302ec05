"""Source checkpoint → flash model folder, one tensor / one FFN layer in memory at a time."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from queue import Empty
from typing import Callable, Sequence

from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Table

from flashllm.convert import native
from flashllm.format.layout import (MANIFEST_FILE, NATIVE, TOKENIZER_FILE, ffn_parts, ffn_weight,
                                    required_tensors)
from flashllm.format.writer import FlashWriter
from flashllm.errors import FlashError, SourceError
from flashllm.units import format_size
from flashllm.convert.sources import open_source
from flashllm.model.tensor import QTensor

ProgressFn = Callable[[int, int], None]


def default_dtype(src: Path) -> str:
    """The conversion a source gets when none is asked for: native for a GGUF file (its own
    types), q8_0 for a Hugging Face folder."""
    return NATIVE if Path(src).is_file() else "q8_0"


def convert(src: Path, out: Path, dtype: str | None, force: bool = False,
            progress: ProgressFn | None = None) -> Path:
    """Convert the checkpoint at src (HF folder or GGUF file) into the flash model folder out, in
    dtype (None: default_dtype). progress(done, total) is called after every tensor, counting
    the bytes the source stores."""
    dtype = dtype or default_dtype(src)
    src, out = Path(src), Path(out)
    if out.exists() and (out.resolve() == src.resolve() or out.resolve() in src.resolve().parents):
        raise FlashError(f"{out} holds the source {src}: the output must be another folder")
    source = open_source(src)
    try:
        return convert_source(source, out, dtype, force=force, progress=progress,
                              description={"path": str(src.resolve()), "name": src.name})
    finally:
        source.close()


def convert_source(source, out: Path, dtype: str, *, force: bool = False,
                   progress: ProgressFn | None = None, description: dict | None = None) -> Path:
    """Write an opened Source (sources.Source protocol) as a flash model folder at out."""
    cfg = source.config
    dense, ffn = _plan(source)
    if dtype == "q4_k" and cfg.n_experts:
        raise SourceError("--dtype q4_k is not supported for a mixture of experts (use q4_1, "
                          "q4_0 or q8_0)")
    if dtype == "q4_k":
        _check_q4_k(source, ffn)
    plan = native.plan(source, ffn) if dtype == NATIVE else None
    nbytes = {n: source.tensor_nbytes(n) for n in source.tensor_names()}   # as the source stores them
    total, done = sum(nbytes.values()), 0
    tick = progress or (lambda done, total: None)
    with FlashWriter(out, cfg, dtype, force=force, source=description,
                     ffn_dtypes=plan and (plan.ffn_dtype, plan.down_dtype)) as w:
        w.set_tokenizer(source.tokenizer_json, source.chat_template)
        for name in dense:
            w.add_tensor(name, *(native.dense_tensor(source, name) if plan else
                                 (source.load(name),)))
            done += nbytes[name]
            tick(done, total)
        for layer in range(cfg.n_layers):
            groups = ffn[layer]
            if cfg.n_experts:
                _write_experts(source, w, layer, groups)
            elif plan:
                gate, up, down, origin = native.ffn_layer(source, groups[""], plan)
                w.add_ffn_layer(layer, gate, up, down, origin=origin)
            else:
                weights = {part: _ffn_part(source, name, part, dtype)
                           for part, name in groups[""].items()}   # (n_ff, d) / (d, n_ff), or QTensor
                w.add_ffn_layer(layer, weights.get("gate"), weights["up"], weights["down"])
            done += sum(nbytes[n] for names in groups.values() for n in names.values())
            tick(done, total)
        return w.finish()


def _write_experts(source, w: FlashWriter, layer: int, groups: dict[str, dict[str, str]]) -> None:
    """An MoE layer's slots: each routed expert in turn (one expert's f32 weights in memory at a
    time), then the shared expert."""
    exps = groups["exps"]
    for e in range(source.config.n_experts):
        w.add_ffn_rows(layer, *(source.load_expert(exps[p], e) for p in ("gate", "up", "down")))
    if "shexp" in groups:
        w.add_ffn_rows(layer, *(source.load(groups["shexp"][p]) for p in ("gate", "up", "down")))


def _ffn_part(source, name: str, part: str, dtype: str):
    """One FFN weight for the writer: f32, or for q4_k gate / up the source's Q4_K rows as is."""
    if dtype == "q4_k" and part != "down":
        rows, cols = source.tensor_shape(name)
        return QTensor(source.load_blocks(name), "q4_k", rows, cols)
    return source.load(name)


def _check_q4_k(source, ffn: list[dict[str, dict[str, str]]]) -> None:
    """SourceError unless every FFN gate / up weight is stored as Q4_K rows (q4_k copies them)."""
    d = source.config.d_model
    if d % 256:
        raise SourceError(f"--dtype q4_k needs d_model a multiple of 256, this model has {d}")
    for groups in ffn:
        parts = groups[""]
        for part in ("gate", "up"):
            name = parts.get(part)
            if name and source.stored_type(name) != "Q4_K":
                raise SourceError(f"--dtype q4_k copies Q4_K gate / up blocks, but {name} is "
                                  f"{source.stored_type(name)} (use --dtype q4_1)")


def _plan(source) -> tuple[list[str], list[dict[str, dict[str, str]]]]:
    """Dense tensor names in source order, and per layer {group: {part: name}} of the FFN
    weights (group "" for a dense FFN, "exps" and "shexp" for an MoE layer's; layout.ffn_weight);
    SourceError when a tensor the architecture needs is missing or misshapen."""
    cfg = source.config
    names = list(source.tensor_names())
    dense = [n for n in names if not ffn_weight(n)]
    for name, shape in required_tensors(cfg).items():
        if name not in dense:
            raise SourceError(f"the checkpoint has no tensor {name}")
        if tuple(source.tensor_shape(name)) != shape:
            raise SourceError(f"tensor {name} has shape {tuple(source.tensor_shape(name))}, "
                              f"the config needs {shape}")
    ffn: list[dict[str, dict[str, str]]] = [{} for _ in range(cfg.n_layers)]
    for n in names:
        key = ffn_weight(n)
        if key and key[0] >= cfg.n_layers:
            raise SourceError(f"tensor {n} is beyond the config's {cfg.n_layers} layers")
        if key:
            ffn[key[0]].setdefault(key[2], {})[key[1]] = n
    want = (["exps"] + (["shexp"] if cfg.n_ff_shared else [])) if cfg.n_experts else [""]
    for layer, groups in enumerate(ffn):
        for group in set(want) | set(groups):
            parts = groups.get(group, {})
            if group not in want or set(parts) != set(ffn_parts(cfg.glu)):
                raise SourceError(f"layer {layer}: FFN weights {sorted(parts)} "
                                  f"{'of the ' + group + ' ' if group else ''}do not match a "
                                  f"{'GLU' if cfg.glu else 'non-GLU'} model (needs "
                                  f"{list(ffn_parts(cfg.glu))})")
        if cfg.n_experts:
            _check_expert_shapes(source, layer, groups)
    return dense, ffn


def _check_expert_shapes(source, layer: int, groups: dict[str, dict[str, str]]) -> None:
    """SourceError unless an MoE layer's FFN tensors have the config's shapes."""
    cfg, d = source.config, source.config.d_model
    want = {("exps", "gate"): (cfg.n_experts, cfg.n_ff, d), ("exps", "up"): (cfg.n_experts, cfg.n_ff, d),
            ("exps", "down"): (cfg.n_experts, d, cfg.n_ff), ("shexp", "gate"): (cfg.n_ff_shared, d),
            ("shexp", "up"): (cfg.n_ff_shared, d), ("shexp", "down"): (d, cfg.n_ff_shared)}
    for group, parts in groups.items():
        for part, name in parts.items():
            if tuple(source.tensor_shape(name)) != want[group, part]:
                raise SourceError(f"tensor {name} has shape {tuple(source.tensor_shape(name))}, "
                                  f"the config needs {want[group, part]}")


@dataclass
class JobResult:
    src: Path
    dest: Path | None          # None when no destination could be chosen
    error: str | None = None   # one line; None on success
    seconds: float = 0.0


def convert_many(srcs: Sequence[Path], out: Path, dtype: str | None, force: bool,
                 console: Console, jobs: int = 1) -> list[tuple[Path, str]]:
    """Convert each source; one source → out is the model folder, several → out/<source stem>.
    jobs > 1 converts that many sources at once in worker processes. A failing source prints
    one line on console and the others still convert; with several sources a summary table
    follows. Returns the failures as (source, message)."""
    pairs = _targets([Path(s) for s in srcs], Path(out))
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TimeElapsedColumn(), TimeRemainingColumn())
    bar = Progress(*columns, console=console) if console.is_terminal else LineProgress(console)
    with bar:
        tasks = [bar.add_task(src.name, total=_source_bytes(src)) for src, _ in pairs]

        def report(r: JobResult, task) -> None:
            if r.error is None:
                bar.update(task, description=f"{r.src.name} → {r.dest}")
                for line in _native_report(r.dest):
                    console.print(f"  {line}", markup=False, soft_wrap=True, highlight=False)
                if not (r.dest / TOKENIZER_FILE).is_file():
                    console.print(f"warning: {r.src} has no tokenizer (tokenizer.json, or a GGUF "
                                  f"vocabulary): {r.dest} converted, but `flashllm run` cannot "
                                  "encode a prompt for it", markup=False, soft_wrap=True,
                                  highlight=False)
            else:
                bar.update(task, visible=False)
                console.print(f"error: {r.error}", markup=False, soft_wrap=True, highlight=False)

        if jobs > 1 and len(pairs) > 1:
            results = _run_pool(pairs, dtype, force, jobs, bar, tasks, report)
        else:
            results = [_run_here(src, dest, dtype, force, bar, task, report)
                       for (src, dest), task in zip(pairs, tasks)]
    if len(pairs) > 1:
        console.print(summary_table(results))
    return [(r.src, r.error) for r in results if r.error is not None]


def _native_report(dest: Path) -> list[str]:
    """What a native conversion at dest copied and re-quantized (nothing for other dtypes)."""
    manifest = json.loads((dest / MANIFEST_FILE).read_text(encoding="utf-8"))
    return native.report(manifest) if manifest.get("dtype") == NATIVE else []


def _source_bytes(src: Path) -> int | None:
    """The size of a source on disk (its weights), the progress total before it is opened."""
    try:
        if src.is_dir():
            return sum(p.stat().st_size for p in src.glob("*.safetensors")) or None
        return src.stat().st_size
    except OSError:
        return None


class LineProgress:
    """Progress as plain lines for a log (stderr not a terminal): each task's name at every
    further 10% and when it completes, with its totals; the subset of rich's Progress the
    converter uses."""

    def __init__(self, console: Console):
        self.console, self.tasks = console, []

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def add_task(self, description: str, total: int | None = None) -> int:
        self.tasks.append({"description": description, "total": total, "shown": -1})
        return len(self.tasks) - 1

    def update(self, task: int, completed: int | None = None, total: int | None = None,
               description: str | None = None, visible: bool = True) -> None:
        t = self.tasks[task]
        t["total"] = total or t["total"]
        if description is not None and visible:
            self.console.print(description, markup=False, highlight=False, soft_wrap=True)
        if completed is None or not t["total"]:
            return
        tenth = min(10, 10 * completed // t["total"])
        if tenth > t["shown"]:
            t["shown"] = tenth
            self.console.print(f"{t['description']}: {10 * tenth}% ({format_size(completed)} of "
                               f"{format_size(t['total'])})", markup=False, highlight=False,
                               soft_wrap=True)


def _one(src: Path, dest: Path | str, dtype: str | None, force: bool, progress: ProgressFn) -> JobResult:
    """Convert one source, its failure as a one-line message naming the source."""
    t0 = time.perf_counter()
    try:
        if isinstance(dest, str):
            raise FlashError(dest)
        convert(src, dest, dtype, force, progress)
        return JobResult(src, dest, None, time.perf_counter() - t0)
    except (FlashError, OSError) as e:
        message = str(e) if str(src) in str(e) else f"{src}: {e}"
        return JobResult(src, None if isinstance(dest, str) else dest, message, time.perf_counter() - t0)


def _run_here(src, dest, dtype, force, bar, task, report) -> JobResult:
    result = _one(src, dest, dtype, force, lambda done, total: bar.update(task, completed=done, total=total))
    report(result, task)
    return result


def _job(queue, index: int, src: Path, dest: Path | str, dtype: str | None, force: bool) -> JobResult:
    """Runs in a worker process: announces its pid (done = -1), then progress by percent steps.
    The progress display is not essential: a queue that has gone away is ignored."""
    shown = [-1]

    def tell(done: int, total: int) -> None:
        try:
            queue.put((index, done, total))
        except (OSError, EOFError):
            pass

    def progress(done: int, total: int) -> None:
        pct = 100 * done // max(total, 1)
        if pct != shown[0]:
            shown[0] = pct
            tell(done, total)

    tell(-1, os.getpid())
    return _one(src, dest, dtype, force, progress)


def _run_pool(pairs, dtype, force, jobs, bar, tasks, report) -> list[JobResult]:
    """Convert the pairs in `jobs` spawned worker processes; a crashed worker fails its source.
    Ctrl-C interrupts the running conversions (each removes its temporary folder) and re-raises."""
    ctx = multiprocessing.get_context("spawn")
    results: list[JobResult | None] = [None] * len(pairs)
    pids: dict[int, int] = {}                  # job index -> worker pid, while it runs
    with ctx.Manager() as manager, ProcessPoolExecutor(max_workers=jobs, mp_context=ctx,
                                                       initializer=_interrupt_once) as pool:
        queue = manager.Queue()
        futures = {pool.submit(_job, queue, i, src, dest, dtype, force): i
                   for i, (src, dest) in enumerate(pairs)}
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
                _drain(queue, bar, tasks, pids)
                for fut in done:
                    i = futures[fut]
                    pids.pop(i, None)
                    results[i] = _result_of(fut, *pairs[i])
                    report(results[i], tasks[i])
        except KeyboardInterrupt:
            _drain(queue, bar, tasks, pids)
            _interrupt(pids.values())
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return results


def _interrupt_once() -> None:
    """Worker setup: the first SIGINT interrupts the conversion (its writer removes the temporary
    folder); later ones — a terminal's Ctrl-C reaches the whole process group and the parent
    forwards one too — are ignored, so the worker can report back instead of dying mid-handler."""
    def once(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, once)


def _interrupt(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGINT)
        except OSError:
            pass


def _drain(queue, bar, tasks, pids: dict[int, int]) -> None:
    while True:
        try:
            index, done, total = queue.get_nowait()
        except (Empty, OSError, EOFError, ValueError):
            return
        if done < 0:
            pids[index] = total
        else:
            bar.update(tasks[index], completed=done, total=total)


def _result_of(fut, src: Path, dest) -> JobResult:
    try:
        return fut.result()
    except BrokenProcessPool:
        return JobResult(src, None, f"{src}: the worker process converting it died (out of memory?)")
    except Exception as e:      # a bug in a worker: reported for that source, the others go on
        return JobResult(src, None, f"{src}: unexpected {type(e).__name__}: {e}")


def summary_table(results: list[JobResult]) -> Table:
    table = Table(title="convert summary", title_justify="left")
    for col in ("source", "output", "status", "size", "time"):
        table.add_column(col)
    for r in results:
        ok = r.error is None
        size = sum(p.stat().st_size for p in r.dest.iterdir()) if ok else 0
        table.add_row(escape(str(r.src)), escape(str(r.dest)) if ok else "-",
                      "ok" if ok else "[red]FAILED[/red]", f"{size / 2**20:.1f} MiB" if ok else "-",
                      f"{r.seconds:.1f} s")
    return table


def _targets(srcs: list[Path], out: Path) -> list[tuple[Path, Path | str]]:
    """(source, destination folder) pairs; a str destination is the reason it cannot be written."""
    if len(srcs) == 1:
        return [(srcs[0], out)]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return [(s, f"cannot create output folder {out}: {e.strerror or e}") for s in srcs]
    pairs: list[tuple[Path, Path | str]] = []
    seen: dict[str, Path] = {}
    for s in srcs:
        stem = s.resolve().stem if s.is_file() else s.resolve().name
        if stem in seen:
            pairs.append((s, f"same output name {stem!r} as {seen[stem]}"))
            continue
        seen[stem] = s
        pairs.append((s, out / stem))
    return pairs
