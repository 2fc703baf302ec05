"""Source checkpoint → flash model folder, one tensor / one FFN layer in memory at a time."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Sequence

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

from .bundle_format import ffn_parts, ffn_weight, required_tensors
from .bundle_write import FlashWriter
from .errors import FlashError, SourceError
from .sources import open_source

ProgressFn = Callable[[int, int], None]


def convert(src: Path, out: Path, dtype: str, force: bool = False,
            progress: ProgressFn | None = None) -> Path:
    """Convert the checkpoint at src (HF folder or GGUF file) into the flash model folder out.
    progress(done, total) is called after every tensor, counting the source's f32 bytes."""
    src = Path(src)
    source = open_source(src)
    try:
        return convert_source(source, Path(out), dtype, force=force, progress=progress,
                              description={"path": str(src.resolve()), "name": src.name})
    finally:
        source.close()


def convert_source(source, out: Path, dtype: str, *, force: bool = False,
                   progress: ProgressFn | None = None, description: dict | None = None) -> Path:
    """Write an opened Source (sources.Source protocol) as a flash model folder at out."""
    cfg = source.config
    dense, ffn = _plan(source)
    nbytes = {n: 4 * math.prod(source.tensor_shape(n)) for n in source.tensor_names()}
    total, done = sum(nbytes.values()), 0
    tick = progress or (lambda done, total: None)
    with FlashWriter(out, cfg, dtype, force=force, source=description) as w:
        w.set_tokenizer(source.tokenizer_json, source.chat_template)
        for name in dense:
            w.add_tensor(name, source.load(name))
            done += nbytes[name]
            tick(done, total)
        for layer in range(cfg.n_layers):
            names = ffn[layer]
            weights = {part: source.load(name) for part, name in names.items()}   # (n_ff, d) / (d, n_ff)
            w.add_ffn_layer(layer, weights.get("gate"), weights["up"], weights["down"])
            done += sum(nbytes[n] for n in names.values())
            tick(done, total)
        return w.finish()


def _plan(source) -> tuple[list[str], list[dict[str, str]]]:
    """Dense tensor names in source order, and per layer {part: name} of the FFN weights;
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
    ffn: list[dict[str, str]] = [{} for _ in range(cfg.n_layers)]
    for n in names:
        key = ffn_weight(n)
        if key and key[0] >= cfg.n_layers:
            raise SourceError(f"tensor {n} is beyond the config's {cfg.n_layers} layers")
        if key:
            ffn[key[0]][key[1]] = n
    for layer, parts in enumerate(ffn):
        missing = set(ffn_parts(cfg.glu)) - set(parts)
        if missing or set(parts) - set(ffn_parts(cfg.glu)):
            raise SourceError(f"layer {layer}: FFN weights {sorted(parts)} do not match a "
                              f"{'GLU' if cfg.glu else 'non-GLU'} model (needs {list(ffn_parts(cfg.glu))})")
    return dense, ffn


def convert_many(srcs: Sequence[Path], out: Path, dtype: str, force: bool,
                 console: Console) -> list[tuple[Path, str]]:
    """Convert each source; one source → out is the model folder, several → out/<source stem>.
    A failing source prints one line on console and the others still convert. Returns the
    failures as (source, message)."""
    failures: list[tuple[Path, str]] = []
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console) as bar:
        for src, dest in _targets([Path(s) for s in srcs], Path(out)):
            task = bar.add_task(src.name, total=None)
            try:
                if isinstance(dest, str):
                    raise FlashError(dest)
                convert(src, dest, dtype, force,
                        lambda done, total: bar.update(task, completed=done, total=total))
                bar.update(task, description=f"{src.name} → {dest}")
            except (FlashError, OSError) as e:
                bar.update(task, visible=False)
                message = str(e) if str(src) in str(e) else f"{src}: {e}"
                failures.append((src, message))
                console.print(f"error: {message}", markup=False, soft_wrap=True, highlight=False)
    return failures


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
