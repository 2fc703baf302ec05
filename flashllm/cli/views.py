"""Terminal views: `flashllm inspect` (one converted model), `flashllm models` (the registry and the
user cache) and `flashllm profile` (a device profile and its cost model). Summaries are plain dicts
(for --json); the rich tables and the throughput chart are views of them."""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import List

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from flashllm.convert.native import report as native_report
from flashllm.format.layout import MANIFEST_FILE, NATIVE
from flashllm.model.tensor import companion
from flashllm.storage.costmodel import CostModel
from flashllm.storage.profile import (CHUNKS, REPEATS, SEQ_THREADS, THREADS, Cell, Profile, measure, scratch_file)
from flashllm.units import KiB, format_size



def folder_bytes(path: Path) -> int:
    """Bytes of the regular files directly inside path (0 when it is not a folder)."""
    if not path.is_dir():
        return 0
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def flash_summary(flash, verify: bool = False) -> dict:
    """A converted model's manifest in brief; verify=True checks every checksum first."""
    verified = None
    if verify:
        t0 = time.perf_counter()
        flash.verify()
        verified = round(time.perf_counter() - t0, 3)
    m, cfg, ffn = flash.manifest, flash.config, flash.ffn
    dense = m["dense"]["tensors"]
    by_dtype: Counter = Counter()
    for t in dense:
        by_dtype[t["dtype"]] += t["nbytes"]
    return {
        "path": str(flash.path), "format_version": m["format_version"],
        "created_by": m.get("created_by"), "source": m.get("source", {}).get("path"),
        "config": cfg.to_dict(), "dtype": flash.dtype,
        "dense": {"tensors": len(dense), "nbytes": m["dense"]["nbytes"], "bytes_by_dtype": dict(by_dtype)},
        "ffn": {"dtype": ffn.dtype, "down_dtype": _per_layer(ffn.down_dtypes),
                "parts": list(m["ffn"]["parts"]),
                "bundle_bytes": ffn.stride if ffn.uniform else list(ffn.strides),
                "bundles": cfg.n_layers * cfg.ffn_slots, "nbytes": m["ffn"]["nbytes"],
                "hot_first_order": ffn.neuron_order is not None},
        "tokenizer": m["tokenizer"].get("file") is not None, "chat_template": flash.chat_template is not None,
        "calibrated": _calibrated(m),
        "sparsity": m["sparsity"], "predictor": m["predictor"],
        "disk_bytes": folder_bytes(flash.path), "verified_s": verified,
        "origin": native_report(m) if flash.dtype == NATIVE else [], "tensors": tensor_rows(m),
    }


def tensor_rows(m: dict) -> list[dict]:
    """Per stored tensor (dense, then each layer's FFN parts): name, dtype and, for a native
    conversion, how it was made from the source (copied / requantized, with the error)."""
    rows = [{"name": t["name"], "dtype": t["dtype"], "shape": t["shape"],
             "origin": t.get("origin")} for t in m["dense"]["tensors"]]
    f = m["ffn"]
    for i, layer in enumerate(f["layers"]):
        dts = {"gate": f["dtype"], "up": f["dtype"],
               "down": layer.get("down_dtype", f.get("down_dtype", companion(f["dtype"])))}
        rows += [{"name": f"blk.{i}.ffn_{p}", "dtype": dts[p], "shape": None,
                  "origin": (layer.get("origin") or {}).get(p)} for p in f["parts"]]
    return rows


def tensors_table(s: dict) -> Table:
    """`flashllm inspect --tensors`: one row per stored tensor and how it was made."""
    table = Table(title=f"{s['path']}: tensors", title_justify="left")
    for col in ("tensor", "stored as", "from the source"):
        table.add_column(col)
    for t in s["tensors"]:
        o = t["origin"]
        how = "" if o is None else f"{o['from']}, copied byte for byte" if o["how"] == "copied" \
            else f"{o['from']}, {o['how']}" if "rel_rms" not in o \
            else f"{o['from']}, re-quantized (relative RMS error {o['rel_rms']:.3%})"
        table.add_row(escape(t["name"]), t["dtype"], how)
    return table


def _per_layer(values) -> str | list:
    """One value when every layer has it, else the per-layer list."""
    return values[0] if len(set(values)) == 1 else list(values)


def _counted(v) -> str:
    """'q4_k' or, per layer, 'q4_k ×15, q6_k ×13' (first-seen order)."""
    if not isinstance(v, list):
        return str(v)
    return ", ".join(f"{x} ×{v.count(x)}" for x in dict.fromkeys(v))


def _bytes_of(v) -> str:
    """'3360' or, per layer, '2592 .. 3008 (mean 2785)'."""
    if not isinstance(v, list):
        return str(v)
    return f"{min(v)} .. {max(v)} (mean {sum(v) / len(v):.0f})"


def _experts(cfg: dict) -> str:
    """' × 64 experts (top 8)' and a shared expert, for a mixture of experts; else ''."""
    if not cfg.get("n_experts"):
        return ""
    shared = f" + a shared expert of {cfg['n_ff_shared']}" if cfg.get("n_ff_shared") else ""
    return f" × {cfg['n_experts']} experts (top {cfg['n_experts_used']}){shared}"


def summary_table(s: dict) -> Table:
    """Two columns, field and value, for `flashllm inspect`."""
    cfg = s["config"]
    table = Table(title=s["path"], show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("model", f"{cfg['arch']}: {cfg['n_layers']} layers × d_model {cfg['d_model']}, n_ff {cfg['n_ff']}"
                  + _experts(cfg) + ", "
                  f"{cfg['n_heads']}/{cfg['n_kv_heads']} heads × {cfg['head_dim']}, vocab {cfg['vocab_size']}, "
                  f"context {cfg['context_length']}"),
        ("ffn", f"{s['ffn']['dtype']} bundles [{' | '.join(s['ffn']['parts'])}] (down "
                f"{_counted(s['ffn']['down_dtype'])}) of {_bytes_of(s['ffn']['bundle_bytes'])} B, "
                f"{s['ffn']['bundles']} bundles, {format_size(s['ffn']['nbytes'])}"
                + (", hot-first order" if s["ffn"]["hot_first_order"] else "")),
        ("dense", f"{s['dense']['tensors']} tensors, {format_size(s['dense']['nbytes'])} ("
                  + ", ".join(f"{d} {format_size(n)}" for d, n in s["dense"]["bytes_by_dtype"].items()) + ")"),
        ("on disk", format_size(s["disk_bytes"])),
        ("tokenizer", ("yes" if s["tokenizer"] else "no") + ", chat template "
                      + ("yes" if s["chat_template"] else "no")),
        ("calibration", "calibrated" if s["calibrated"] else "not calibrated (dense: every neuron is read)"),
        ("source", str(s["source"])),
        ("format", f"version {s['format_version']}, {s['created_by']}"),
    ]
    if s["verified_s"] is not None:
        rows.append(("checksums", f"all verified ({s['verified_s']:.2f} s)"))
    if s["origin"]:
        rows.append(("from the source", "\n".join(s["origin"]) + "\n(per tensor: --tensors)"))
    for field, value in rows:
        table.add_row(field, escape(value))
    return table


def catalog(registry, cache: Path) -> list[dict]:
    """One row per registry entry and per converted folder in the cache not from the registry."""
    converted = cache / "converted"
    folders = sorted(p for p in converted.iterdir() if p.is_dir()) if converted.is_dir() else []
    folders = [p for p in folders if not p.name.startswith(".")]
    rows = []
    for name, entry in registry.entries.items():
        gguf = cache / "models" / f"{name}.gguf"
        mine = [p for p in folders if p.name.rsplit("-", 1)[0] == name]
        pulled = gguf.is_file() and gguf.stat().st_size == entry.size
        rows.append({"name": name, "arch": entry.arch, "description": entry.description,
                     "size": entry.size, "pulled": pulled, "gguf": str(gguf) if pulled else None,
                     "converted": [_converted_row(p) for p in mine],
                     "unsupported": entry.unsupported})
        folders = [p for p in folders if p not in mine]
    for p in folders:
        rows.append({"name": p.name, "arch": None, "description": "converted folder in the cache",
                     "size": None, "pulled": False, "gguf": None, "converted": [_converted_row(p)],
                     "unsupported": None})
    return rows


def _converted_row(path: Path) -> dict:
    """A converted folder: its dtype and calibration from its manifest (else the dtype its name
    ends with, as `run NAME` names a conversion), whether it is complete, its bytes on disk."""
    manifest = _manifest_of(path)
    dtype = manifest.get("dtype")
    return {"path": str(path),
            "dtype": dtype if isinstance(dtype, str) else path.name.rsplit("-", 1)[-1],
            "calibrated": _calibrated(manifest),
            "complete": (path / MANIFEST_FILE).is_file(), "disk_bytes": folder_bytes(path)}


def _calibrated(manifest: dict) -> bool:
    """Whether `flashllm calibrate` wrote thresholds or a predictor into a manifest."""
    return bool(manifest.get("sparsity")) or bool(manifest.get("predictor"))


def _manifest_of(path: Path) -> dict:
    """A folder's manifest as far as it reads as a JSON object; {} otherwise (`models` lists
    what is there, and `inspect` says what is wrong with it)."""
    from flashllm.runtime.budget import BudgetError, read_manifest
    try:
        m = read_manifest(path)
    except BudgetError:
        return {}
    return m if isinstance(m, dict) else {}


def models_table(rows: list[dict], cache: Path) -> Table:
    table = Table(title="models (models.toml and the user cache)", title_justify="left",
                  caption=f"fetched GGUF files: {cache / 'models'}; conversions: "
                          f"{cache / 'converted'}", caption_justify="left")
    for col in ("name", "arch", "GGUF", "pulled", "converted"):
        table.add_column(col, no_wrap=True)
    table.add_column("description")
    for r in rows:
        conv = ", ".join(f"{c['dtype']}{' calibrated' if c['calibrated'] else ''} "
                         f"{format_size(c['disk_bytes'])}"
                         + ("" if c["complete"] else " (incomplete)") for c in r["converted"]) or "-"
        note = f" (unsupported: {r['unsupported']})" if r["unsupported"] else ""
        table.add_row(r["name"], r["arch"] or "-", format_size(r["size"]) if r["size"] else "-",
                      "yes" if r["pulled"] else "no", conv, escape(r["description"] + note))
    return table


# ---- device profile ----------------------------------------------------------------------

BAR_WIDTH = 32


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
        row = [format_size(chunk)]
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
        lines.append(f"{format_size(chunk):>8} │{bar:<{BAR_WIDTH}} {best.gib_s:5.2f} GiB/s "
                     f"@{best.threads}t (1t {one.gib_s:.2f})")
    return Text("\n".join(lines))


def model_table(model: CostModel) -> Table:
    """The fitted a + c/B per thread count and what it implies."""
    table = Table(title=f"cost model: time per read = a + chunk / B  ({model.source})")
    for name in ("threads", "a (µs)", "B (GiB/s)", "merge gap", "32 KiB GiB/s"):
        table.add_column(name, justify="right")
    for t, fit in model.fits.items():
        table.add_row(str(t), f"{fit.overhead * 1e6:.1f}", f"{fit.bandwidth / 2**30:.2f}",
                      format_size(fit.merge_gap) if fit.merge_gap else "0", f"{fit.gib_s(32 * KiB):.2f}")
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
                            description=f"{cell.kind} {format_size(cell.chunk)} × {cell.threads} thr")

        if target.is_file():
            return measure(target, seconds, on_cell=on_cell)
        writing = progress.add_task(f"writing scratch file in {target}", total=size)
        with scratch_file(target, size, lambda n: progress.advance(writing, n)) as path:
            progress.update(writing, visible=False)
            return measure(path, seconds, on_cell=on_cell)
