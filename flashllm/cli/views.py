"""What is on disk: `flashllm inspect` (one converted model) and `flashllm models` (the registry
and the user cache). Summaries are plain dicts (for --json); the rich tables are views of them."""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from flashllm.format.layout import MANIFEST_FILE


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
        "ffn": {"dtype": ffn.dtype, "parts": list(m["ffn"]["parts"]), "bundle_bytes": ffn.stride,
                "bundles": cfg.n_layers * cfg.n_ff, "nbytes": m["ffn"]["nbytes"],
                "hot_first_order": ffn.neuron_order is not None},
        "tokenizer": m["tokenizer"].get("file") is not None, "chat_template": flash.chat_template is not None,
        "calibrated": bool(m["sparsity"]) or bool(m["predictor"]),
        "sparsity": m["sparsity"], "predictor": m["predictor"],
        "disk_bytes": folder_bytes(flash.path), "verified_s": verified,
    }


def human(n: int | float) -> str:
    """Bytes in binary units: 1.5 GiB, 320 MiB, 4 KiB, 12 B."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def summary_table(s: dict) -> Table:
    """Two columns, field and value, for `flashllm inspect`."""
    cfg = s["config"]
    table = Table(title=s["path"], show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("model", f"{cfg['arch']}: {cfg['n_layers']} layers × d_model {cfg['d_model']}, n_ff {cfg['n_ff']}, "
                  f"{cfg['n_heads']}/{cfg['n_kv_heads']} heads × {cfg['head_dim']}, vocab {cfg['vocab_size']}, "
                  f"context {cfg['context_length']}"),
        ("ffn", f"{s['ffn']['dtype']} bundles [{' | '.join(s['ffn']['parts'])}] of {s['ffn']['bundle_bytes']} B, "
                f"{s['ffn']['bundles']} bundles, {human(s['ffn']['nbytes'])}"
                + (", hot-first order" if s["ffn"]["hot_first_order"] else "")),
        ("dense", f"{s['dense']['tensors']} tensors, {human(s['dense']['nbytes'])} ("
                  + ", ".join(f"{d} {human(n)}" for d, n in s["dense"]["bytes_by_dtype"].items()) + ")"),
        ("on disk", human(s["disk_bytes"])),
        ("tokenizer", ("yes" if s["tokenizer"] else "no") + ", chat template "
                      + ("yes" if s["chat_template"] else "no")),
        ("calibration", "calibrated" if s["calibrated"] else "not calibrated (dense: every neuron is read)"),
        ("source", str(s["source"])),
        ("format", f"version {s['format_version']}, {s['created_by']}"),
    ]
    if s["verified_s"] is not None:
        rows.append(("checksums", f"all verified ({s['verified_s']:.2f} s)"))
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
        rows.append({"name": name, "arch": entry.arch, "description": entry.description,
                     "size": entry.size, "pulled": gguf.is_file() and gguf.stat().st_size == entry.size,
                     "converted": [_converted_row(p) for p in mine],
                     "unsupported": entry.unsupported})
        folders = [p for p in folders if p not in mine]
    for p in folders:
        rows.append({"name": p.name, "arch": None, "description": "converted folder in the cache",
                     "size": None, "pulled": False, "converted": [_converted_row(p)], "unsupported": None})
    return rows


def _converted_row(path: Path) -> dict:
    return {"path": str(path), "dtype": path.name.rsplit("-", 1)[-1],
            "complete": (path / MANIFEST_FILE).is_file(), "disk_bytes": folder_bytes(path)}


def models_table(rows: list[dict]) -> Table:
    table = Table(title="models (models.toml and the user cache)", title_justify="left")
    for col in ("name", "arch", "GGUF", "pulled", "converted"):
        table.add_column(col, no_wrap=True)
    table.add_column("description")
    for r in rows:
        conv = ", ".join(f"{c['dtype']} {human(c['disk_bytes'])}" + ("" if c["complete"] else " (incomplete)")
                         for c in r["converted"]) or "-"
        note = f" (unsupported: {r['unsupported']})" if r["unsupported"] else ""
        table.add_row(r["name"], r["arch"] or "-", human(r["size"]) if r["size"] else "-",
                      "yes" if r["pulled"] else "no", conv, escape(r["description"] + note))
    return table
