"""The native conversion of a GGUF (`--dtype native`, the default for GGUF sources): every tensor
stays in its own ggml type, byte for byte, where the kernel has that type; what cannot stay is
re-quantized, and how each tensor was made is recorded in the manifest (`origin`).

- Dense 2-D tensors (attention, embeddings, output head): copied (F32, F16, Q8_0, Q4_0, Q4_1,
  Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K); BF16 is widened to f32 (exact); any other type
  (IQ*, TQ*) is re-quantized to q8_0 (f16 when a row is not whole blocks of 32).
- FFN gate / up rows are the source's rows: copied when every layer stores both in one type the
  kernel has and d_model is whole blocks of it; else re-quantized to q8_0.
- FFN down columns cut across the source's row blocks, so they are always re-quantized, per
  layer (down_column): a k-quant source layer's to the k-quant one step finer than its own
  (ggml's reference quantizer, native/kquant.c) when d_model is whole superblocks of 256: Q4_K
  to q5_k, Q5_K and Q6_K to q6_k (none finer), Q2_K and Q3_K to q4_k (the smallest flashllm
  makes), so a Q4_K_M model's columns are q6_k and q5_k; a second rounding to the source's own
  grid cost prose +2.3% perplexity (docs/QUALITY.md). Any other layer's to q8_0 (f16 when
  d_model is not whole blocks of 32): at least as precise as the 32-block types a GGUF stores
  them in. A smaller 32-block type was measured:
  q5_1 columns (one bit per weight more than SmolLM2's Q4_1, 3.9% relative RMS error) cost its
  perplexity 3.8% (11.38 against 10.97 with q8_0 columns, 8 chunks of the evaluation text).
  Each layer has its own bundle stride (docs/FORMAT.md), so a smaller column is fewer bytes read.
The error of a re-quantization is its relative RMS, |requantized - source| / |source|, over the
tensor (the source's dequantized values are the reference).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashllm.errors import SourceError
from flashllm.ffi.quant import dequantize_rows, quantize_rows
from flashllm.convert.recipe import (FALLBACK, KQUANT_DOWN, SAME_KQUANT, coarser,  # noqa: F401
                                     down_column, keeps_rows, outdated)
from flashllm.format.layout import fits
from flashllm.model.tensor import FROM_GGML, QTensor

BLOCK_VALUES = 1 << 18   # values of a tensor made at a time (1 MiB as f32): whole rows, or
                         # whole neurons of an FFN layer


@dataclass(frozen=True)
class NativePlan:
    ffn_dtype: str          # the bundles' gate / up rows
    gate_up_copied: bool    # False: re-quantized to ffn_dtype (the source's type does not fit)
    down_dtypes: tuple      # per layer: the down column's dtype
    down_rows: bool = False  # the down matrices are also kept as the source stores them


def check_source(source) -> None:
    """SourceError unless source stores its own types (a GGUF)."""
    if not source.stores_blocks:
        raise SourceError(f"{source.path}: a native conversion keeps a GGUF's own types; this "
                          "source has none (choose --dtype)")


def plan(source, ffn: list[dict[str, dict[str, str]]], kquants: dict = KQUANT_DOWN) -> NativePlan:
    """The FFN dtypes of a native conversion of source (ffn: per layer {"": {part: tensor
    name}}; a mixture of experts': convert/native_moe.py); kquants: the down columns' k-quant
    per stored type (down_column; SAME_KQUANT: the recipe before)."""
    check_source(source)
    d = source.config.d_model
    stored = [source.stored_type(g[""]["down"]) for g in ffn]
    types = {source.stored_type(n) for groups in ffn for p, n in groups[""].items() if p != "down"}
    dt = FROM_GGML.get(types.pop()) if len(types) == 1 else None
    copied = dt is not None and fits(dt, d)
    downs = tuple(down_column(t, d, kquants) for t in stored)
    return NativePlan(dt if copied else FALLBACK, copied, downs,
                      keeps_rows(stored, source.config.n_ff))


class RmsError:
    """|got - ref| / |ref| over every value of a tensor given in blocks (0 for an all-zero ref)."""

    def __init__(self) -> None:
        self.num = self.den = 0.0

    def add(self, got: np.ndarray, ref: np.ndarray) -> None:
        self.num += float(np.sum(np.square(got - ref, dtype=np.float64)))
        self.den += float(np.sum(np.square(ref, dtype=np.float64)))

    @property
    def value(self) -> float:
        return float(np.sqrt(self.num)) / float(np.sqrt(self.den)) if self.den else 0.0


def rel_rms(got: np.ndarray, ref: np.ndarray) -> float:
    """|got - ref| / |ref| over every value (0 for an all-zero ref)."""
    err = RmsError()
    err.add(got, ref)
    return err.value


def blocks(n: int, cols: int, align: int = 1):
    """(r0, r1) of consecutive blocks covering rows 0 .. n, of about BLOCK_VALUES values each
    (rows of cols values), a multiple of align rows but the last."""
    step = max(align, BLOCK_VALUES // cols // align * align)
    return ((r0, min(n, r0 + step)) for r0 in range(0, n, step))


def requantize(x: np.ndarray, dtype: str, err: RmsError) -> np.ndarray:
    """x (rows, cols) f32 quantized to dtype (rows, row_bytes), its error added to err."""
    data = quantize_rows(x, dtype)                                       # (rows, row_bytes)
    err.add(dequantize_rows(data, dtype, x.shape[1]), x)
    return data


def requantized_origin(stored: str, dtype: str) -> dict:
    """A re-quantized tensor's origin; its rel_rms is filled in once every block is made."""
    return {"from": stored, "to": dtype, "how": "requantized", "rel_rms": None}


def write_dense(w, source, name: str) -> None:
    """Write a dense tensor: 1-D as f32; 2-D in the source's own type when the kernel has it
    (its bytes), else widened or re-quantized a block of rows at a time; with its origin."""
    shape = tuple(source.tensor_shape(name))
    if len(shape) == 1:
        return w.add_tensor(name, source.load(name))
    stored = source.stored_type(name)
    dt = FROM_GGML.get(stored)
    if dt is not None and fits(dt, shape[1]):
        return w.add_tensor(name, QTensor(source.load_blocks(name), dt, *shape),
                            {"from": stored, "how": "copied"})
    if stored == "BF16":
        rows = (source.load_rows(name, *b).view(np.uint8) for b in blocks(*shape))
        return w.add_tensor_rows(name, shape, rows, "f32", {"from": stored, "how": "widened"})
    dt = FALLBACK if fits(FALLBACK, shape[1]) else "f16"
    origin, err = requantized_origin(stored, dt), RmsError()

    def made():
        for b in blocks(*shape):
            yield requantize(source.load_rows(name, *b), dt, err)       # (rows, row_bytes)
        origin["rel_rms"] = round(err.value, 7)
    w.add_tensor_rows(name, shape, made(), dt, origin)


def write_ffn_layer(w, source, layer: int, names: dict[str, str], p: NativePlan) -> None:
    """Write one layer's bundles in the plan's dtypes, a block of neurons at a time (down as its
    columns), with their origin, and the down matrix as the source stores it (down_rows)."""
    origin, errs = {}, {}
    for part, name in names.items():
        stored = source.stored_type(name)
        if part == "down" or not p.gate_up_copied:
            dt = p.down_dtypes[layer] if part == "down" else p.ffn_dtype
            origin[part], errs[part] = requantized_origin(stored, dt), RmsError()
        else:
            origin[part] = {"from": stored, "how": "copied"}
    n_ff, d = source.tensor_shape(names["up"])
    for n0, n1 in blocks(n_ff, d, source.col_block(names["down"])):
        parts = {}
        for part, name in names.items():
            if part == "down":
                x = np.ascontiguousarray(source.load_cols(name, n0, n1).T)   # (n, d_model)
            elif p.gate_up_copied:
                parts[part] = QTensor(source.load_blocks(name)[n0:n1], p.ffn_dtype, n1 - n0, d)
                continue
            else:
                x = source.load_rows(name, n0, n1)                           # (n, d_model)
            dt = origin[part]["to"]
            parts[part] = QTensor(requantize(x, dt, errs[part]), dt, n1 - n0, d)
        if n1 == n_ff:
            for part, err in errs.items():
                origin[part]["rel_rms"] = round(err.value, 7)
        w.add_ffn_rows(layer, parts.get("gate"), parts["up"], parts["down"], origin=origin)
    if p.down_rows:       # byte for byte: a run holding the whole FFN in DRAM multiplies these
        d, n_ff = source.tensor_shape(names["down"])
        w.add_down_rows(layer, QTensor(source.load_blocks(names["down"]),
                                       FROM_GGML[source.stored_type(names["down"])], d, n_ff))


def report(manifest: dict) -> list[str]:
    """What a native conversion copied and re-quantized, in a few lines (convert prints them)."""
    kept, redone = {"copied": {}, "widened": {}}, {}
    entries = [t.get("origin") for t in manifest["dense"]["tensors"]]
    for layer in manifest["ffn"]["layers"]:
        entries += list((layer.get("origin") or {}).values())
    for o in filter(None, entries):
        if o["how"] == "requantized":
            redone.setdefault((o["from"], o["to"]), []).append(o["rel_rms"])
        else:
            kept[o["how"]][o["from"]] = kept[o["how"]].get(o["from"], 0) + 1
    label = {"copied": "copied byte for byte", "widened": "widened to f32"}
    lines = [f"{label[how]}: " + ", ".join(f"{n} {t}" for t, n in sorted(kept[how].items()))
             for how in kept if kept[how]]
    rows = {}
    for e in (manifest.get("down_rows") or {}).get("layers", []):
        rows[e["dtype"].upper()] = rows.get(e["dtype"].upper(), 0) + 1
    if rows:
        lines.append("FFN down rows kept as they are (down.bin): "
                     + ", ".join(f"{n} {t}" for t, n in sorted(rows.items())))
    for (src, dst), errs in sorted(redone.items()):
        lines.append(f"re-quantized {src} -> {dst}: {len(errs)} tensor{'s' * (len(errs) != 1)}, "
                     f"relative RMS error "
                     f"{min(errs):.3%} .. {max(errs):.3%} (mean {np.mean(errs):.3%})")
    return lines
