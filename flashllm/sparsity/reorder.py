"""Hot-first FFN layout: neurons sorted by a calibration key (calibrate's: each neuron's expected
contribution E|h| * ||down||), so the ones the caches hold sit together (pinned and read in
larger merged chunks), and the per-slot frequency file (in the new slot order).

A rewrite never touches the files the manifest names: the reordered FFN file, order file and
frequency file go under the other name of each pair below (temporary name, fsync, rename), the
manifest is switched to them in one atomic rename (format/writer.update_manifest), and only then
are the old files removed. An interrupted rewrite leaves the old model valid; the stray new files
are overwritten by the next calibration.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import numpy as np

from flashllm.format.layout import FFN_ALIGN, MANIFEST_FILE, crc32_array
from flashllm.format.files import sweep_leftovers, update_manifest
from flashllm.format.reader import FlashModel
from flashllm.errors import FormatError

FFN_NAMES = ("ffn.bin", "ffn-hot.bin")
ORDER_NAMES = ("order.bin", "order-hot.bin")
FREQ_NAMES = ("frequency.bin", "frequency-hot.bin")


def sweep_temporaries(folder: Path) -> None:
    """Remove the temporary files a killed calibration (an OOM-killed child) left in folder:
    those of the files calibration writes whose writer is gone (format/files.sweep_leftovers)."""
    from flashllm.sparsity.predictor import PREDICTOR_FILE
    for name in (*FFN_NAMES, *ORDER_NAMES, *FREQ_NAMES, PREDICTOR_FILE, MANIFEST_FILE):
        sweep_leftovers(Path(folder) / name)


def hot_first_permutation(key: np.ndarray) -> np.ndarray:
    """(n_layers, n_ff) int32: row l lists layer l's slots by key (n_layers, n_ff), highest first
    (stable)."""
    return np.argsort(-np.asarray(key), axis=1, kind="stable").astype(np.int32)


def _other(current: Optional[str], names: tuple[str, str]) -> str:
    return names[1] if current == names[0] else names[0]


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
    name = _other(current, FREQ_NAMES)
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
    """Reorder every layer's slots by key (n_layers, n_ff) (per current slot, highest first;
    default freq), write the new FFN, order and frequency (freq, n_layers x n_ff, in the new slot
    order) files, switch the manifest (ffn + sparsity sections, sparsity gets hot_first and the
    frequency entry), remove the old files. Returns the new sparsity section."""
    path, man = flash.path, flash.manifest
    perm = hot_first_permutation(freq if key is None else key)               # (n_layers, n_ff)
    old_order = flash.ffn.neuron_order
    order = perm if old_order is None else np.take_along_axis(old_order, perm, axis=1)
    order = np.ascontiguousarray(order, dtype="<i4")                         # (n_layers, n_ff)
    old = {"ffn": man["ffn"]["file"], "order": (man["ffn"].get("neuron_order") or {}).get("file"),
           "freq": (man.get("sparsity", {}).get("frequency") or {}).get("file")}
    ffn_name, order_name = _other(old["ffn"], FFN_NAMES), _other(old["order"], ORDER_NAMES)
    layers = _write_ffn(flash, perm, ffn_name)
    _sync_write(path / order_name, lambda f: f.write(order.tobytes()))
    freq_sorted = np.take_along_axis(np.asarray(freq, np.float32), perm, axis=1)  # (n_layers, n_ff)
    section = {**sparsity, "hot_first": True,
               "frequency": {**sparsity.get("frequency", {}),
                             **write_frequency(path, freq_sorted, old["freq"])}}
    ffn = {**man["ffn"], "file": ffn_name, "layers": layers,
           "neuron_order": _array_entry(order_name, order, "int32")}
    update_manifest(path, ffn=ffn, sparsity=section)
    for key, new in (("ffn", ffn_name), ("order", order_name), ("freq", section["frequency"]["file"])):
        if old[key] and old[key] != new:
            (path / old[key]).unlink(missing_ok=True)
    return section

