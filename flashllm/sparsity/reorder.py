"""Hot-first FFN layout: neurons sorted by a calibration key (calibrate's: each neuron's expected
contribution E|h| * ||down||), so the ones the caches hold sit together (pinned and read in
larger merged chunks), and the per-slot frequency file (in the new slot order).

A rewrite never touches the files the manifest names: the reordered FFN file, order file and
frequency file go under the other name of each pair below (temporary name, fsync, rename), and
calibrate trains its predictor on them (sparsity/predictor.write_predictor, also under a free
name) before the manifest is switched to all of them in one atomic rename (format/files.switch);
only then are the old files removed. A calibration killed at any point (SIGKILL, the OOM
killer) or failing on a full disk leaves the old folder, valid, or the new one, complete; the
stray new or old files are removed at once after an error (a full disk), else by the next
calibration (sweep_temporaries) or by `run` after its calibration child failed.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import numpy as np

from flashllm.format.layout import FFN_ALIGN, MANIFEST_FILE, crc32_array
from flashllm.format.files import free_name, named_files, sweep_leftovers, switch
from flashllm.format.manifest import read_manifest
from flashllm.format.reader import FlashModel
from flashllm.errors import FormatError

FFN_NAMES = ("ffn.bin", "ffn-hot.bin")
ORDER_NAMES = ("order.bin", "order-hot.bin")
FREQ_NAMES = ("frequency.bin", "frequency-hot.bin")


def sweep_temporaries(folder: Path) -> None:
    """Remove what a killed calibration (an OOM-killed child) left in folder: the temporary
    files of the files calibration writes whose writer is gone (format/files.sweep_leftovers),
    and those of its files, complete, that the manifest does not name (written before the
    switch, or stale ones after it: reorder's module doc). Call it holding the folder's lock
    (sparsity/attempt.hold): a live calibration's files are not yet named."""
    from flashllm.sparsity.predictor import PREDICTOR_NAMES
    names = (*FFN_NAMES, *ORDER_NAMES, *FREQ_NAMES, *PREDICTOR_NAMES)
    for name in (*names, MANIFEST_FILE):
        sweep_leftovers(Path(folder) / name)
    try:
        named = named_files(read_manifest(folder, validate=False).to_dict())
    except FormatError:                  # no manifest: nothing known to be unused
        return
    for name in names:
        if name not in named:
            (Path(folder) / name).unlink(missing_ok=True)


def hot_first_permutation(key: np.ndarray) -> np.ndarray:
    """(n_layers, n_ff) int32: row l lists layer l's slots by key (n_layers, n_ff), highest first
    (stable)."""
    return np.argsort(-np.asarray(key), axis=1, kind="stable").astype(np.int32)


def _sync_write(path: Path, write) -> None:
    """write(f) into path via a temporary name, fsync, rename; nothing at path on failure."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise FormatError(f"cannot write {path}: {e.strerror or e}") from None
        raise


def _array_entry(name: str, a: np.ndarray, dtype: str) -> dict:
    return {"file": name, "nbytes": int(a.nbytes), "crc32": crc32_array(a), "dtype": dtype,
            "shape": list(a.shape)}


def write_frequency(path: Path, freq: np.ndarray, current: Optional[str]) -> dict:
    """Write per-slot frequencies (n_layers, n_ff) as little-endian f32 under the free name;
    return its table entry for the sparsity section."""
    a = np.ascontiguousarray(freq, dtype="<f4")                               # (n_layers, n_ff)
    name = free_name(current, FREQ_NAMES)
    _sync_write(Path(path) / name, lambda f: f.write(a.tobytes()))
    return {**_array_entry(name, a, "float32"), "index": "slot"}


def _write_ffn(flash: FlashModel, perm: np.ndarray, name: str) -> list[dict]:
    """The FFN file with layer l's slots in the order perm[l]; returns the new layer entries."""
    f = flash.ffn
    layers = []

    def write(out) -> None:
        with open(f.file, "rb") as src:
            out.write(src.read(FFN_ALIGN))                                   # identical header
        for layer in range(flash.config.n_layers):
            bundles = flash.read_ffn_layer(layer)[perm[layer]]               # (n_ff, stride) uint8
            out.seek(f.layer_offsets[layer])
            out.write(bundles.tobytes())
            layers.append({**flash.manifest["ffn"]["layers"][layer],    # origin, own stride
                           "crc32": crc32_array(bundles)})
        out.truncate(flash.manifest["ffn"]["nbytes"])                        # trailing padding
    _sync_write(flash.path / name, write)
    return layers


def rewrite_hot_first(flash: FlashModel, freq: np.ndarray, sparsity: dict,
                      key: Optional[np.ndarray] = None) -> dict:
    """write_hot_first, then the manifest switched to its files (switch). Returns the new
    sparsity section."""
    sections, stale = write_hot_first(flash, freq, sparsity, key)
    switch(flash.path, stale, **sections)
    return sections["sparsity"]


def write_hot_first(flash: FlashModel, freq: np.ndarray, sparsity: dict,
                    key: Optional[np.ndarray] = None) -> tuple[dict, list[str]]:
    """Reorder every layer's slots by key (n_layers, n_ff) (per current slot, highest first;
    default freq): the new FFN, order and frequency (freq, n_layers x n_ff, in the new slot
    order) files written under their free names, the manifest left as it is. Returns (the
    manifest sections that name them: ffn, and sparsity with hot_first and the frequency entry;
    the files they replace, for switch)."""
    path, man = flash.path, flash.manifest
    perm = hot_first_permutation(freq if key is None else key)               # (n_layers, n_ff)
    old_order = flash.ffn.neuron_order
    order = perm if old_order is None else np.take_along_axis(old_order, perm, axis=1)
    order = np.ascontiguousarray(order, dtype="<i4")                         # (n_layers, n_ff)
    old = {"ffn": man["ffn"]["file"], "order": (man["ffn"].get("neuron_order") or {}).get("file"),
           "freq": (man.get("sparsity", {}).get("frequency") or {}).get("file")}
    ffn_name, order_name = free_name(old["ffn"], FFN_NAMES), free_name(old["order"], ORDER_NAMES)
    layers = _write_ffn(flash, perm, ffn_name)
    _sync_write(path / order_name, lambda f: f.write(order.tobytes()))
    freq_sorted = np.take_along_axis(np.asarray(freq, np.float32), perm, axis=1)  # (n_layers, n_ff)
    section = {**sparsity, "hot_first": True,
               "frequency": {**sparsity.get("frequency", {}),
                             **write_frequency(path, freq_sorted, old["freq"])}}
    ffn = {**man["ffn"], "file": ffn_name, "layers": layers,
           "neuron_order": _array_entry(order_name, order, "int32")}
    stale = [n for n, new in zip(old.values(), (ffn_name, order_name, section["frequency"]["file"]))
             if n and n != new]
    return {"ffn": ffn, "sparsity": section}, stale
