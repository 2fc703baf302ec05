"""One expert's FFN over its bytes as ffn.bin stores them (docs/FORMAT.md, "A mixture of experts"):
the same math for the experts held in DRAM (runtime/moe.py) and those read from flash
(runtime/expert_ffn.py).

- Expert rows (a native conversion: the GGUF's own gate, up and down rows): three matrix
  products as llama.cpp computes an expert — [gate; up] rows times h, act(g)·u, down rows times
  that (both on int8-quantized activations, as matmul does, unless exact). Experts held in DRAM
  are repacked for this build's matmul where it has a packed layout for their type (kernel.pack,
  as the dense rows are).
- Bundles (other conversions): fl_ffn_bundles over the expert's slots, down columns added one
  neuron at a time.
"""
from __future__ import annotations

from typing import Union

import numpy as np

from flashllm.ffi import kernel
from flashllm.ffi.kernel import PackedTensor
from flashllm.format.layout import expert_spans
from flashllm.format.reader import FfnLayout
from flashllm.model.tensor import QTensor

Matrix = Union[QTensor, PackedTensor]


def expert_rows(f: FfnLayout, layer: int, slots: np.ndarray) -> tuple[QTensor, QTensor]:
    """([gate; up] (2n, d_model), down (d_model, n)) of an expert stored as rows in slots (n,
    stride) uint8 of layer: views of its bytes."""
    n, flat = len(slots), slots.reshape(-1)                              # (n stride,)
    g, u, dn = expert_spans(f.dtype, f.down_dtypes[layer], f.d_model, n)
    gate_up = QTensor(flat[:g + u].reshape(2 * n, -1), f.dtype, 2 * n, f.d_model)
    down = QTensor(flat[g + u:g + u + dn].reshape(f.d_model, -1), f.down_dtypes[layer], f.d_model, n)
    return gate_up, down


def packs_in_place(f: FfnLayout, layer: int, n: int) -> bool:
    """Whether an expert of n neurons of layer, stored as rows, repacks over its own bytes
    (kernel.pack in place: q4_0, q5_0, q8_0, q6_k layouts under AVX-512 VNNI / AVX2)."""
    g, u, dn = expert_spans(f.dtype, f.down_dtypes[layer], f.d_model, n)
    return f.expert_rows and kernel.packed_nbytes(f.dtype, 2 * n, f.d_model) == g + u and \
        kernel.packed_nbytes(f.down_dtypes[layer], f.d_model, n) == dn


def packed(w: QTensor) -> Matrix:
    """w repacked for this build's matmul (a new array, or w's bytes), or w when it has none."""
    return kernel.pack(w, in_place=True) or w


class ExpertMath:
    """y += expert(h) over an expert's slots, for one folder's FFN layout."""

    def __init__(self, f: FfnLayout, act: str, n_threads: int = 1, exact: bool = False):
        self.f, self.act, self.n_threads, self.exact = f, act, n_threads, exact

    def matrices(self, layer: int, slots: np.ndarray, pack: bool) -> tuple[Matrix, Matrix] | np.ndarray:
        """What run() takes for an expert of layer in slots (n, stride): its two matrices
        (repacked when pack and not exact) with expert rows, else the slots themselves."""
        if not self.f.expert_rows:
            return slots
        gate_up, down = expert_rows(self.f, layer, slots)
        if pack and not self.exact:
            return packed(gate_up), packed(down)
        return gate_up, down

    def pack_slots(self, layer: int, slots: np.ndarray) -> None:
        """Repack an expert's rows over its own bytes in slots (n, stride) (packs_in_place)."""
        for w in expert_rows(self.f, layer, slots):
            kernel.pack(w, in_place=True)

    def packed_views(self, layer: int, slots: np.ndarray) -> tuple[PackedTensor, PackedTensor]:
        """The two matrices of an expert pack_slots repacked, as views of slots (n, stride)."""
        gate_up, down = expert_rows(self.f, layer, slots)
        return tuple(PackedTensor(w.data.reshape(-1), w.dtype, w.rows, w.cols)
                     for w in (gate_up, down))

    def run(self, layer: int, expert, h: np.ndarray, y: np.ndarray) -> None:
        """y (T, d) += the expert's gated FFN of h (T, d); expert: matrices() or slots (n,
        stride) uint8."""
        if isinstance(expert, np.ndarray) and self.f.expert_rows:
            expert = self.matrices(layer, expert, pack=False)
        if isinstance(expert, np.ndarray):
            kernel.ffn_bundles(expert, self.f.dtype, self.f.d_model, True, self.act, h, y,
                               n_threads=self.n_threads, exact=self.exact,
                               down_dtype=self.f.down_dtypes[layer])
            return
        gate_up, down = expert
        n = down.cols
        gu = kernel.matmul(gate_up, h, None, self.n_threads, self.exact)  # (T, 2n)
        a = kernel.act_mul(self.act, gu[:, :n], gu[:, n:])               # (T, n)
        y += kernel.matmul(down, a, None, self.n_threads, self.exact)     # (T, d)
