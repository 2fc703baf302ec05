"""FFN strategies: how a layer's feed-forward network is computed from its bundles.

The model calls `ffn.start_pass(T, prefill)` once per forward pass, then `ffn(layer, h, x)` per
layer: x (T, d_model) += FFN(h), h (T, d_model) the normalized FFN input (the model adds the down
bias afterwards). prefill says the pass evaluates a prompt; a decode pass feeds one sampled token
and any draft guesses (flashllm/generation/speculate.py). A strategy also reports `stats()` for --stats.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from flashllm.ffi import kernel


def bundle_ids(flash, layer: int) -> Optional[np.ndarray]:
    """(n_ff,) int32 neuron id of each stored bundle slot when neurons are reordered, else None."""
    order = flash.ffn.neuron_order                      # (n_layers, n_ff) int32 or None
    if order is None:
        return None
    return np.ascontiguousarray(order[layer], dtype=np.int32)  # (n_ff,)


def up_biases(flash) -> list[Optional[np.ndarray]]:
    """Per layer the (n_ff,) up bias indexed by neuron id, or None (GLU models have none)."""
    name = "blk.{}.ffn_up.bias"
    return [flash.tensor(name.format(i)) if flash.has(name.format(i)) else None
            for i in range(flash.config.n_layers)]


class DenseFfn:
    """Every bundle of every layer read into DRAM once; each token runs the whole FFN."""

    def __init__(self, flash, n_threads: int = 1, threshold: Optional[list[float]] = None,
                 exact: bool = False):
        cfg = flash.config
        self.dtype, self.d, self.glu, self.act = flash.ffn.dtype, cfg.d_model, cfg.glu, cfg.act
        self.down_dtypes = flash.ffn.down_dtypes                          # per layer
        self.n_threads = n_threads
        self.bundles = [np.ascontiguousarray(flash.read_ffn_layer(i))   # (n_ff, stride) uint8
                        for i in range(cfg.n_layers)]
        self.ids = [bundle_ids(flash, i) for i in range(cfg.n_layers)]  # (n_ff,) int32 or None
        self.up_b = up_biases(flash)                                     # (n_ff,) or None
        self.threshold = threshold or [0.0] * cfg.n_layers              # per-layer |h| cut-off
        self.exact = exact                                    # f32 instead of int8 activations

    def start_pass(self, n_tokens: int, prefill: bool) -> None:
        pass

    def __call__(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        kernel.ffn_bundles(self.bundles[layer], self.dtype, self.d, self.glu, self.act, h, x,
                           ids=self.ids[layer], up_bias=self.up_b[layer],
                           threshold=self.threshold[layer], n_threads=self.n_threads,
                           exact=self.exact, down_dtype=self.down_dtypes[layer])

    def stats(self) -> dict:
        return {"ffn": "dense"}
