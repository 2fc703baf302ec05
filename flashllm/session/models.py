"""What the model-management commands do, for the CLI to print: MODEL resolved to a converted
folder, convert, pull, the models catalog, a converted model's summary (inspect) and a device
profile. Summaries are plain dicts (the CLI's --json, and the views it draws of them)."""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

Log = Callable[[str], None]


def resolve(model: str, cache: Path, registry: Path, log: Log, apart: bool = False) -> Path:
    """MODEL as given on the command line: a converted folder, a GGUF file or a models.toml name
    (both converted once into cache; in a child process with `apart`, so the conversion's
    memory stays out of this one)."""
    from flashllm.convert.resolve import resolve_model
    return resolve_model(model, cache, registry, log=log, apart=apart)


def convert(sources: list, out: Path, dtype: Optional[str], force: bool, console,
            jobs: int) -> list:
    """convert's work (convert/batch.convert_many): the (source, error) of each that failed."""
    from flashllm.convert.batch import convert_many
    return convert_many(sources, out, dtype, force, console=console, jobs=jobs)


def pull(name: str, cache: Path, registry: Path, log: Log) -> Path:
    """A models.toml entry's file fetched into cache and verified: its path."""
    from flashllm.convert.registry import load_registry, pull as pull_model
    return pull_model(load_registry(registry).get(name), cache, log=log)


def models(cache: Path, registry: Path) -> list[dict]:
    """The models catalog (catalog) of registry and the user cache."""
    from flashllm.convert.registry import load_registry
    return catalog(load_registry(registry), cache)


def inspect(path: Path, verify: bool = False) -> dict:
    """The summary of the converted model at path (flash_summary)."""
    from flashllm.format.reader import open_flash
    return flash_summary(open_flash(path), verify=verify)


def profile_device(target: Path, size: int, seconds: float, cache: Path, on_cell,
                   on_written):
    """(the Profile of target, an existing file read, or of a scratch file of size bytes in the
    folder target, written with on_written(n) and removed afterwards; its CostModel; where it
    was saved for `run`). on_cell(cell) after each measured cell."""
    from flashllm.storage.costmodel import CostModel
    from flashllm.storage.profile import measure, save_profile, scratch_file
    if target.is_file():
        result = measure(target, seconds, on_cell=on_cell)
    else:
        with scratch_file(target, size, on_written) as path:
            result = measure(path, seconds, on_cell=on_cell)
    return result, CostModel.from_profile(result), save_profile(result, cache)


def profile_cells() -> int:
    """How many cells profile_device measures (a progress bar's total)."""
    from flashllm.storage.profile import CHUNKS, REPEATS, SEQ_THREADS, THREADS
    return (len(SEQ_THREADS) + len(CHUNKS) * len(THREADS)) * REPEATS


def folder_bytes(path: Path) -> int:
    """Bytes of the regular files directly inside path (0 when it is not a folder)."""
    if not path.is_dir():
        return 0
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def flash_summary(flash, verify: bool = False) -> dict:
    """A converted model's manifest in brief; verify=True checks every checksum first."""
    from flashllm.convert.native import report as native_report
    from flashllm.convert.recipe import coarser
    from flashllm.format.layout import NATIVE
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
                "hot_first_order": ffn.neuron_order is not None,
                "expert_rows": ffn.expert_rows},
        "tokenizer": m["tokenizer"].get("file") is not None, "chat_template": flash.chat_template is not None,
        "calibrated": _calibrated(m),
        "sparsity": m["sparsity"], "predictor": m["predictor"],
        "disk_bytes": folder_bytes(flash.path), "verified_s": verified,
        "origin": native_report(m) if flash.dtype == NATIVE else [], "tensors": tensor_rows(m),
        "older_recipe": coarser(m),
    }


def tensor_rows(m: dict) -> list[dict]:
    """Per stored tensor (dense, then each layer's FFN parts): name, dtype and, for a native
    conversion, how it was made from the source (copied / requantized, with the error)."""
    from flashllm.model.tensor import companion
    rows = [{"name": t["name"], "dtype": t["dtype"], "shape": t["shape"],
             "origin": t.get("origin")} for t in m["dense"]["tensors"]]
    f = m["ffn"]
    for i, layer in enumerate(f["layers"]):
        dts = {"gate": f["dtype"], "up": f["dtype"],
               "down": layer.get("down_dtype", f.get("down_dtype", companion(f["dtype"])))}
        origin = layer.get("origin") or {}
        names = {p: f"blk.{i}.ffn_{p}" + ("_exps" if f.get("experts") else "") for p in f["parts"]}
        names.update({f"shexp_{p}": f"blk.{i}.ffn_{p}_shexp" for p in f["parts"]
                      if f"shexp_{p}" in origin})
        rows += [{"name": name, "dtype": dts[key.removeprefix("shexp_")], "shape": None,
                  "origin": origin.get(key)} for key, name in names.items()]
    return rows


def _per_layer(values) -> str | list:
    """One value when every layer has it, else the per-layer list."""
    return values[0] if len(set(values)) == 1 else list(values)


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
    from flashllm.format.layout import MANIFEST_FILE
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
    from flashllm.errors import FlashError
    from flashllm.format.manifest import read_manifest
    try:
        return read_manifest(path, validate=False)
    except FlashError:
        return {}


