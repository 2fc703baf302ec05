"""FFN strategies: how a layer's feed-forward network is computed from its bundles.

The model calls `ffn.start_pass(T, prefill, pos0)` once per forward pass (its tokens stand at
positions pos0 ..), then `ffn(layer, h, x)` per layer: x (T, d_model) += FFN(h), h (T, d_model)
the normalized FFN input (the model adds the down bias afterwards). prefill says the pass
evaluates a prompt; a decode pass feeds one sampled token and any draft guesses
(flashllm/generation/speculate.py). A strategy also reports `stats()` for --stats, and
close() releases what it holds (runtime/interfaces.py FfnStrategy declares the seam).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from flashllm.ffi import kernel
from flashllm.format.reader import FlashModel
from flashllm.model.tensor import QTensor
from flashllm.model.archs.tensors import BY_FIELD
from flashllm.runtime.interfaces import FfnStrategy


def bundle_ids(flash: FlashModel, layer: int) -> Optional[np.ndarray]:
    """(n_ff,) int32 neuron id of each stored bundle slot when neurons are reordered, else None."""
    order = flash.ffn.neuron_order                      # (n_layers, n_ff) int32 or None
    if order is None:
        return None
    return np.ascontiguousarray(order[layer], dtype=np.int32)  # (n_ff,)


def up_biases(flash: FlashModel) -> list[Optional[np.ndarray]]:
    """Per layer the (n_ff,) up bias indexed by neuron id, or None (GLU models have none)."""
    up_b = BY_FIELD["up_b"]
    return [flash.tensor(up_b.at(i)) if flash.has(up_b.at(i)) else None
            for i in range(flash.config.n_layers)]


def gate_up_rows(flash: FlashModel, layer: int) -> QTensor:
    """Layer `layer`'s gate rows then up rows (up only for a non-GLU model), each in neuron id
    order, copied out of its bundles: (2 n_ff, d_model) (or (n_ff, d_model)) in the FFN dtype."""
    f, ids = flash.ffn, bundle_ids(flash, layer)
    b = flash.read_ffn_layer(layer)                                      # (n_ff, stride) uint8
    k = 2 if f.glu else 1
    rows = np.empty((k * f.n_ff, f.part_bytes), np.uint8)                 # (k n_ff, part_bytes)
    for part in range(k):
        dst = rows[part * f.n_ff:(part + 1) * f.n_ff]                     # (n_ff, part_bytes)
        src = b[:, part * f.part_bytes:(part + 1) * f.part_bytes]         # (n_ff, part_bytes)
        if ids is None:
            dst[:] = src
        else:
            dst[ids] = src
    return QTensor(rows, f.dtype, k * f.n_ff, f.d_model)


# The rows path multiplies a GGUF's own matrices on int8 activations as llama.cpp does, and
# computes the activation as llama.cpp's CPU backend does too: its GELU goes through ggml's f16
# table (the input and the value rounded to f16). On Gemma 3 those roundings decide which of
# the down projection's 8-bit activations flip (docs/history/2026-11-29-gemma-agreement.md).
LLAMACPP_ACT = {"gelu_tanh": "gelu_tanh_f16"}


class DenseFfn(FfnStrategy):
    """The whole FFN in DRAM; each token runs all of it. A folder with the source's own down
    matrices (down.bin) runs as three matrix products per layer — gate and up rows (copied out
    of the bundles) times x, the activation, the down rows times h — as llama.cpp does (`rows`;
    k-quant, q8_0, q5_0 and q4_0 matrices repacked 16 rows at a time where the build has that
    kernel: kernel.pack);
    otherwise (older folders, `exact`, or magnitude thresholds) over the bundles, the down
    columns added one neuron at a time (fl_ffn_bundles)."""

    def __init__(self, flash: FlashModel, n_threads: int = 1, threshold: Optional[list[float]] = None,
                 exact: bool = False, summary: str = "", layers: Optional[list[int]] = None):
        """summary: the DRAM plan of a budget that holds the whole FFN (for stats()); layers:
        the only layers read (None: all; runtime/layer_pass.py runs one at a time)."""
        cfg = flash.config
        held = set(range(cfg.n_layers) if layers is None else layers)
        self.summary = summary
        self.dtype, self.d, self.glu, self.act = flash.ffn.dtype, cfg.d_model, cfg.glu, cfg.act
        self.down_dtypes = flash.ffn.down_dtypes                          # per layer
        self.n_threads, self.n_ff = n_threads, cfg.n_ff
        self.up_b = up_biases(flash)                                     # (n_ff,) or None
        self.threshold = threshold or [0.0] * cfg.n_layers              # per-layer |h| cut-off
        self.exact = exact                                    # f32 instead of int8 activations
        self.rows = flash.down_rows is not None and not exact and not any(self.threshold)
        if self.rows:      # repacked for this build's matmul where it has a packed layout
            self.act = LLAMACPP_ACT.get(cfg.act, cfg.act)
            packed = lambda w: kernel.pack(w, in_place=True) or w
            self.gate_up = [packed(gate_up_rows(flash, i)) if i in held else None
                            for i in range(cfg.n_layers)]                     # (k n_ff, d)
            self.down = [packed(flash.read_down_rows(i)) if i in held else None
                         for i in range(cfg.n_layers)]                        # (d, n_ff)
            return
        self.bundles = [np.ascontiguousarray(flash.read_ffn_layer(i)) if i in held else None
                        for i in range(cfg.n_layers)]                         # (n_ff, stride) uint8
        self.ids = [bundle_ids(flash, i) for i in range(cfg.n_layers)]  # (n_ff,) int32 or None

    def start_pass(self, n_tokens: int, prefill: bool, pos0: int = 0) -> None:
        pass

    def __call__(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        if self.rows:
            gu = kernel.matmul(self.gate_up[layer], h, None, self.n_threads)  # (T, k n_ff)
            g, u = (gu[:, :self.n_ff], gu[:, self.n_ff:]) if self.glu else (None, gu)
            if self.up_b[layer] is not None:
                u = u + self.up_b[layer]                                  # (T, n_ff)
            a = kernel.act_mul(self.act, g, u)                            # (T, n_ff)
            x += kernel.matmul(self.down[layer], a, None, self.n_threads)  # (T, d)
            return
        kernel.ffn_bundles(self.bundles[layer], self.dtype, self.d, self.glu, self.act, h, x,
                           ids=self.ids[layer], up_bias=self.up_b[layer],
                           threshold=self.threshold[layer], n_threads=self.n_threads,
                           exact=self.exact, down_dtype=self.down_dtypes[layer])

    def stats(self) -> dict:
        return {"ffn": "dense", "plan": {"summary": self.summary}} if self.summary else \
            {"ffn": "dense"}
