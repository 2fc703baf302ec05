"""A mixture of experts' FFN layers written as each expert's rows (docs/FORMAT.md, EXPERT_ROWS):
what FlashWriter.add_expert_rows checks and lays out, and the down dtypes each layout takes. An
expert's slots hold its gate rows, its up rows (n, d_model) in the FFN dtype, then its down rows
(d_model, n) in the layer's down dtype, back to back, zero padding at the end of its n slots.
"""
from __future__ import annotations

import numpy as np

from flashllm.errors import FormatError
from flashllm.format.layout import fits
from flashllm.model.config import ModelConfig
from flashllm.model.tensor import DOWN_DTYPES, QTensor


def check_downs(cfg: ModelConfig, downs: list[str], expert_rows: bool) -> None:
    """FormatError unless every layer's down dtype can hold its part: a bundle's column of
    d_model values, or with expert rows (a mixture of experts) rows of n_ff values (and of the
    shared expert's n_ff_shared)."""
    if not expert_rows:
        if not set(downs) <= set(DOWN_DTYPES):
            raise FormatError(f"a bundle's down column cannot be {sorted(set(downs))}")
        return
    if not cfg.n_experts:
        raise FormatError("expert rows need a mixture of experts")
    for n in filter(None, (cfg.n_ff, cfg.n_ff_shared)):
        bad = sorted(dt for dt in set(downs) if not fits(dt, n))
        if bad:
            raise FormatError(f"an expert's down rows of {n} values cannot be {bad}")


def expert_slots(layer: int, gate: QTensor, up: QTensor, down: QTensor, d_model: int,
                 dtypes: tuple[str, str], stride: int, room: int) -> np.ndarray:
    """One expert of layer `layer` as its slots (n, stride) uint8: gate, up (n, d_model) in
    dtypes[0], down (d_model, n) in dtypes[1] (the layer's down dtype), their bytes back to
    back; room: the layer's slots left to write. FormatError naming a part of another shape or
    dtype, or an expert too large for the room left."""
    n, (ffn, dd) = gate.rows, dtypes
    for part, w, want in (("gate", gate, (n, d_model, ffn)), ("up", up, (n, d_model, ffn)),
                          ("down", down, (d_model, n, dd))):
        if (w.rows, w.cols, w.dtype) != want:
            raise FormatError(f"layer {layer}: expert {part} rows are {(w.rows, w.cols, w.dtype)}, "
                              f"expected {want}")
    if n > room:
        raise FormatError(f"layer {layer}: {n} FFN slots given, {room} left to write")
    block = np.zeros(n * stride, np.uint8)                                # (n stride,)
    at = 0
    for w in (gate, up, down):
        block[at:at + w.data.nbytes] = w.data.reshape(-1)
        at += w.data.nbytes
    return block.reshape(n, stride)                                       # (n, stride)
