"""How many of the cold neurons a token actually needs (issue 15, item 3: reads that follow the
exact activation). Under a budget the hottest `--hot` share of each layer's neurons (slots
0 .. n_hot-1 in hot-first order) stay in DRAM and every other bundle is read every token; a
read that followed the exact activation would fetch the down column of a cold neuron only when
its |h| passes the layer's calibrated threshold. Per layer: the share of cold neurons active per
token, and the share of 4 KiB pages of packed cold down columns (in slot order) holding no active
one — what such a layout could skip.

    python -m scripts.studies.cold_activity $FLASHLLM_CACHE/converted/qwen2.5-coder-1.5b-native-cal \\
        build/bench/prompt-qwen2.5-coder-1.5b-native.txt --tokens 64 --hot 0.5

Runs the dense model over the prompt's tokens (teacher-forced), captures each layer's FFN input,
and scores every neuron exactly (sparsity/activations.py, slow: dequantizes each layer).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from flashllm.format.reader import open_flash
from flashllm.generation.tokenizer import Tokenizer
from flashllm.model.tensor import row_bytes
from flashllm.runtime.ffn import DenseFfn
from flashllm.runtime.model import Model
from flashllm.sparsity.activations import (active_mask, default_criterion, ffn_activations,
                                           manifest_thresholds)

PAGE = 4096


class Recording(DenseFfn):
    """The dense FFN, keeping each layer's input h (T, d_model) of the pass."""

    def __init__(self, flash, n_threads: int):
        super().__init__(flash, n_threads)
        self.inputs: dict[int, np.ndarray] = {}

    def __call__(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        self.inputs[layer] = h.copy()                                    # (T, d_model)
        super().__call__(layer, h, x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("prompt", type=Path)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hot", type=float, default=0.5, help="share of neurons kept in DRAM")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    flash = open_flash(a.model)
    cfg = flash.config
    thresholds = manifest_thresholds(flash.manifest, cfg.n_layers)
    if not any(thresholds):
        raise SystemExit(f"{a.model}: not calibrated (no thresholds): run flashllm calibrate")
    crit = flash.manifest.get("sparsity", {}).get("criterion") or default_criterion(cfg)
    ids = Tokenizer.from_flash(flash).encode(a.prompt.read_text(), add_special=True)[:a.tokens]
    ffn = Recording(flash, a.threads)
    Model(flash, n_threads=a.threads, n_ctx=len(ids), ffn=ffn).forward(np.array(ids), 0)
    n_hot = int(a.hot * cfg.n_ff)
    per_page = max(1, PAGE // row_bytes(flash.ffn.down_dtypes[0], cfg.d_model))
    print(f"{a.model.name}: {len(ids)} tokens, cold = slots {n_hot}..{cfg.n_ff - 1}, "
          f"~{per_page} down columns a page")
    print("layer  cold active/token  pages with none active  all neurons active/token")
    cold_all, empty_all = [], []
    for i in range(cfg.n_layers):
        scores = ffn_activations(flash, i, ffn.inputs[i], crit)          # (T, n_ff) slot order
        mask = active_mask(scores, thresholds[i], crit)                  # (T, n_ff) bool
        cold = mask[:, n_hot:]                                           # (T, n_cold)
        n_pages = cold.shape[1] // per_page
        pages = cold[:, :n_pages * per_page].reshape(len(ids), n_pages, per_page).any(axis=2)
        cold_all.append(cold.mean())
        empty_all.append(1.0 - pages.mean())
        print(f"{i:5d}  {cold.mean():17.3f}  {1.0 - pages.mean():22.3f}  {mask.mean():24.3f}")
    print(f"mean   {np.mean(cold_all):17.3f}  {np.mean(empty_all):22.3f}")


if __name__ == "__main__":
    main()
