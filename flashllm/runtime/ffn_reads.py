"""Reads of an FFN layer's bundles from ffn.bin into DRAM rows through a direct-I/O reader, each
read's reader counters added to the token's stats: what runtime/sparse_ffn.py's SparseFlashFfn
reads its cache rows and staging buffer with."""
from __future__ import annotations

from typing import Optional

import numpy as np

from flashllm.runtime.stats import TokenStats
from flashllm.storage.costmodel import CostModel, batch_reads
from flashllm.storage.readahead import reader_delta


class FfnReads:
    """Bundles of f (the model's FFN file: strides, layer offsets) read through `reader`; a batch
    of scattered bundles is merged across the gaps `cost` pays for."""

    def __init__(self, f, reader, cost: CostModel):
        self.f, self.reader, self.cost = f, reader, cost

    def read_seq(self, layer: int, slots: np.ndarray, out: np.ndarray,
                 t: Optional[TokenStats]) -> None:
        """Consecutive slots (k,) → out rows 0 .. k-1 in one sequential run (cut into the
        reader's largest reads)."""
        if len(slots):
            s = self.f.strides[layer]
            start = self.f.layer_offsets[layer] + int(slots[0]) * s
            nbytes = np.array([len(slots) * s])                          # (1,)
            self._counted(t, self.reader.read, np.array([start]), nbytes, out.reshape(-1),
                          np.array([0]), max_gap=0, max_run=0)

    def read_rows(self, layer: int, slots: np.ndarray, out: np.ndarray, rows: np.ndarray,
                  t: Optional[TokenStats]) -> None:
        """Bundles slots (k,) sorted → rows (k,) of out, merged across gaps the cost model pays."""
        s, base = self.f.strides[layer], self.f.layer_offsets[layer]
        offsets = base + slots.astype(np.int64) * s                      # (k,)
        lengths = np.full(len(slots), s, dtype=np.int64)                 # (k,)
        gap, run = batch_reads(self.cost, offsets, lengths, self.reader.n_threads)
        self._counted(t, self.reader.read_bundles, base, s, slots, out, rows,
                      max_gap=gap, max_run=run)

    def _counted(self, t: Optional[TokenStats], read, *args, **kwargs) -> None:
        """read(*args, **kwargs), its reader counters added to t."""
        before = self.reader.stats()
        read(*args, **kwargs)
        if t is not None:
            t.add_reads(reader_delta(before, self.reader.stats()))
