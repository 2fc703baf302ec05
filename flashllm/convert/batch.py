"""Several conversions at once (`flashllm convert a.gguf b/ -o out --jobs N`): a target per source,
worker processes, progress as a bar on a terminal or plain lines in a log, Ctrl-C / SIGTERM
handled once, and the summary table."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from queue import Empty
from typing import Sequence

from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Table

from flashllm.convert import native
from flashllm.convert.convert import ProgressFn, convert
from flashllm.errors import FlashError
from flashllm.format.layout import NATIVE, TOKENIZER_FILE
from flashllm.format.lock import exclusive
from flashllm.format.manifest import read_manifest
from flashllm.units import format_size


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
    manifest = read_manifest(dest)
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
        if not dest.parent.is_dir():     # a new folder (the writer makes it, or says why not)
            convert(src, dest, dtype, force, progress)
        else:
            with exclusive(dest.parent / f".{dest.name}.lock",   # a run's conversion's, calibrate's
                           busy=f"another flashllm process is converting or calibrating {dest}: "
                           "let it finish first"):
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

    _interrupt_once()                       # Ctrl-C interrupts this job, not an idle worker
    try:
        tell(-1, os.getpid())
        return _one(src, dest, dtype, force, progress)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_pool(pairs, dtype, force, jobs, bar, tasks, report) -> list[JobResult]:
    """Convert the pairs in `jobs` spawned worker processes; a crashed worker fails its source.
    Ctrl-C interrupts the running conversions (each removes its temporary folder) and re-raises."""
    ctx = multiprocessing.get_context("spawn")
    results: list[JobResult | None] = [None] * len(pairs)
    pids: dict[int, int] = {}                  # job index -> worker pid, while it runs
    with ctx.Manager() as manager, ProcessPoolExecutor(max_workers=jobs, mp_context=ctx,
                                                       initializer=_ignore_interrupts) as pool:
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


def _ignore_interrupts() -> None:
    """Worker setup: an idle worker ignores SIGINT (a terminal's Ctrl-C reaches the whole process
    group; one that met a finished job's worker printed its traceback); `_job` listens."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _interrupt_once() -> None:
    """While a job runs: the first SIGINT interrupts the conversion (its writer removes the
    temporary folder); later ones — a terminal's Ctrl-C reaches the whole process group and the
    parent forwards one too — are ignored, so the worker can report back instead of dying
    mid-handler."""
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
