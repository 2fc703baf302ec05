"""Terminal views of a profile and a cost model: rich tables and a throughput-vs-chunk chart."""
from __future__ import annotations

from pathlib import Path
from typing import List

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from flashllm.storage.costmodel import CostModel
from flashllm.storage.profile import (CHUNKS, REPEATS, SEQ_THREADS, THREADS, Cell, KiB, MiB, Profile, measure,
                      scratch_file)

BAR_WIDTH = 32


def size_label(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB and n % MiB == 0 else f"{n // KiB} KiB"


def profile_table(profile: Profile) -> Table:
    """Random reads: one row per chunk size, GiB/s and IOPS per thread count."""
    threads = sorted({c.threads for c in profile.cells if c.kind == "random"})
    chunks = sorted({c.chunk for c in profile.cells if c.kind == "random"})
    mode = "direct I/O" if profile.direct else "page cache (O_DIRECT refused)"
    flight = "reads in flight (io_uring)" if profile.engine == "io_uring" else "threads (pool)"
    table = Table(title=f"random reads on {profile.device.name}, {mode}, thr = {flight}: GiB/s (kIOPS)")
    table.add_column("chunk", justify="right")
    for t in threads:
        table.add_column(f"{t} thr", justify="right")
    for chunk in chunks:
        row = [size_label(chunk)]
        for t in threads:
            cell = profile.get("random", chunk, t)
            row.append(f"{cell.gib_s:.2f} ({cell.iops / 1000:.1f})" if cell else "–")
        table.add_row(*row)
    return table


def sequential_table(profile: Profile) -> Table:
    table = Table(title="sequential reads, 1 MiB")
    table.add_column("threads", justify="right")
    table.add_column("GiB/s", justify="right")
    for cell in (c for c in profile.cells if c.kind == "seq"):
        table.add_row(str(cell.threads), f"{cell.gib_s:.2f}")
    return table


def throughput_chart(profile: Profile) -> Text:
    """One bar per chunk size: the best thread count (█) and 1 thread (▒)."""
    cells = [c for c in profile.cells if c.kind == "random"]
    top = max((c.gib_s for c in cells), default=0.0) or 1.0
    lines: List[str] = ["throughput vs chunk size (█ best threads, ▒ 1 thread)"]
    for chunk in sorted({c.chunk for c in cells}):
        row = [c for c in cells if c.chunk == chunk]
        best = max(row, key=lambda c: c.gib_s)
        one = next((c for c in row if c.threads == 1), best)
        n_best, n_one = round(best.gib_s / top * BAR_WIDTH), round(one.gib_s / top * BAR_WIDTH)
        bar = "▒" * min(n_one, n_best) + "█" * max(0, n_best - n_one)
        lines.append(f"{size_label(chunk):>8} │{bar:<{BAR_WIDTH}} {best.gib_s:5.2f} GiB/s "
                     f"@{best.threads}t (1t {one.gib_s:.2f})")
    return Text("\n".join(lines))


def model_table(model: CostModel) -> Table:
    """The fitted a + c/B per thread count and what it implies."""
    table = Table(title=f"cost model: time per read = a + chunk / B  ({model.source})")
    for name in ("threads", "a (µs)", "B (GiB/s)", "merge gap", "32 KiB GiB/s"):
        table.add_column(name, justify="right")
    for t, fit in model.fits.items():
        table.add_row(str(t), f"{fit.overhead * 1e6:.1f}", f"{fit.bandwidth / 2**30:.2f}",
                      size_label(fit.merge_gap) if fit.merge_gap else "0", f"{fit.gib_s(32 * KiB):.2f}")
    return table


def run_profile(console: Console, target: Path, size: int, seconds: float) -> Profile:
    """Measure target (an existing file, read-only) or a scratch file of size bytes in the
    folder target (removed afterwards, also on Ctrl-C), with progress bars on console."""
    columns = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        n_cells = (len(SEQ_THREADS) + len(CHUNKS) * len(THREADS)) * REPEATS
        measuring = progress.add_task("measuring", total=n_cells, visible=False)

        def on_cell(cell: Cell) -> None:
            progress.update(measuring, advance=1, visible=True,
                            description=f"{cell.kind} {size_label(cell.chunk)} × {cell.threads} thr")

        if target.is_file():
            return measure(target, seconds, on_cell=on_cell)
        writing = progress.add_task(f"writing scratch file in {target}", total=size)
        with scratch_file(target, size, lambda n: progress.advance(writing, n)) as path:
            progress.update(writing, visible=False)
            return measure(path, seconds, on_cell=on_cell)
