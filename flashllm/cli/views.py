"""Terminal views: `flashllm inspect` (one converted model), `flashllm models` (the registry and the
user cache) and `flashllm profile` (a device profile and its cost model). The summaries are plain
dicts from the session layer (session/models.py, for --json); the rich tables and the throughput
chart are views of them."""
from __future__ import annotations

from pathlib import Path
from typing import List

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from flashllm.units import KiB, format_size


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


def _ffn_kind(ffn: dict) -> str:
    """'bundles', or for experts stored as their source's rows 'expert rows'."""
    return "expert rows" if ffn.get("expert_rows") else "bundles"


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
        ("ffn", f"{s['ffn']['dtype']} {_ffn_kind(s['ffn'])} [{' | '.join(s['ffn']['parts'])}] (down "
                f"{_counted(s['ffn']['down_dtype'])}) of {_bytes_of(s['ffn']['bundle_bytes'])} B, "
                f"{s['ffn']['bundles']} bundles, {format_size(s['ffn']['nbytes'])}"
                + (", hot-first order" if s["ffn"]["hot_first_order"] else "")),
        ("dense", f"{s['dense']['tensors']} tensors, {format_size(s['dense']['nbytes'])} ("
                  + ", ".join(f"{d} {format_size(n)}" for d, n in s["dense"]["bytes_by_dtype"].items()) + ")"),
        ("on disk", format_size(s["disk_bytes"])),
        ("tokenizer", ("yes" if s["tokenizer"] else "no") + ", chat template "
                      + ("yes" if s["chat_template"] else "no")),
        ("calibration", calibration_words(s)),
        ("source", str(s["source"])),
        ("format", f"version {s['format_version']}, {s['created_by']}"),
    ]
    if s["verified_s"] is not None:
        rows.append(("checksums", f"all verified ({s['verified_s']:.2f} s)"))
    if s["origin"]:
        rows.append(("from the source", "\n".join(s["origin"]) + "\n(per tensor: --tensors)"))
    if s.get("older_recipe"):
        rows.append(("older recipe", s["older_recipe"]))
    for field, value in rows:
        table.add_row(field, escape(value))
    return table


def calibration_words(s: dict) -> str:
    """`inspect`'s calibration row: the target kept, what it costs on each text checked, the
    texts and tokens calibrated on, how long it took."""
    from flashllm.session.calibration import checked_by_older_rule, checked_words
    sec = s["sparsity"] or {}
    if not s["calibrated"]:
        return "not calibrated (dense: every neuron is read)"
    if "target" not in sec:
        return "calibrated (a predictor only)"
    q, cal = sec.get("quality") or {}, sec.get("calibration") or {}
    asked = f" (asked {q['requested']})" if q.get("requested", sec["target"]) != sec["target"] else ""
    words = [f"target {sec['target']}{asked}"]
    if "bound" in q:
        words.append(f"perplexity {checked_words(q)}")
        if checked_by_older_rule(q):
            words.append("checked by an older rule (no literature, against the bundles): "
                         "calibrate again")
    text = cal.get("text") or {}
    texts = text.get("texts") or [text]
    tokens = {p["text"]: p["n_tokens"] for p in text.get("parts", [])}
    words.append(f"{cal.get('n_tokens')} tokens of " + ", ".join(
        f"{t.get('kind', 'text')} ({t.get('path') or t.get('source')}"
        + (f", {tokens[t['kind']]} tokens" if len(texts) > 1 and t.get("kind") in tokens else "")
        + ")" for t in texts))
    if cal.get("seconds") is not None:
        words.append(f"took {cal['seconds'] / 60:.1f} min")
    return "calibrated: " + "; ".join(words)


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


def profile_table(profile) -> Table:
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


def sequential_table(profile) -> Table:
    table = Table(title="sequential reads, 1 MiB")
    table.add_column("threads", justify="right")
    table.add_column("GiB/s", justify="right")
    for cell in (c for c in profile.cells if c.kind == "seq"):
        table.add_row(str(cell.threads), f"{cell.gib_s:.2f}")
    return table


def throughput_chart(profile) -> Text:
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


def model_table(model) -> Table:
    """The fitted a + c/B per thread count and what it implies."""
    table = Table(title=f"cost model: time per read = a + chunk / B  ({model.source})")
    for name in ("threads", "a (µs)", "B (GiB/s)", "merge gap", "32 KiB GiB/s"):
        table.add_column(name, justify="right")
    for t, fit in model.fits.items():
        table.add_row(str(t), f"{fit.overhead * 1e6:.1f}", f"{fit.bandwidth / 2**30:.2f}",
                      format_size(fit.merge_gap) if fit.merge_gap else "0", f"{fit.gib_s(32 * KiB):.2f}")
    return table


def run_profile(console: Console, target: Path, size: int, seconds: float, cache: Path):
    """session.models.profile_device of target with progress bars on console: (the Profile,
    its CostModel, where it was saved)."""
    from flashllm.session.models import profile_cells, profile_device
    columns = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        measuring = progress.add_task("measuring", total=profile_cells(), visible=False)
        writing = progress.add_task(f"writing scratch file in {target}", total=size,
                                    visible=not target.is_file())

        def on_cell(cell) -> None:
            progress.update(writing, visible=False)
            progress.update(measuring, advance=1, visible=True,
                            description=f"{cell.kind} {format_size(cell.chunk)} × {cell.threads} thr")

        return profile_device(target, size, seconds, cache, on_cell,
                              lambda n: progress.advance(writing, n))
