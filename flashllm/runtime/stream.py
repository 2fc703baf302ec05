"""A static pass's read stream: everything a forward pass reads when its reads do not depend on
its tokens, in the order it uses them, read ahead by one ReadAhead (flashllm/storage/readahead.py)
into a ring of page-aligned buffers.

Why and when: docs/ARCHITECTURE.md, "The read-ahead". The stream is built first (pass_stream,
from runtime/assemble.py) and handed to the three that take from it: the SparseFlashFfn (each
layer's FFN chunks past its pinned cache rows), the DenseWeights (each layer's streamed attention
matrices, one entry before its FFN chunks; the streamed output head after the last layer) and
the SparseHead (the head's sketch in the head's place). The read-ahead reads it over and over,
across layers and passes.

    stream = pass_stream(flash, reader, staging_rows, streamed, slots, first, head)
    stream.start()                                   once the FFN's reader is free (pins read)
    first, rows, counters = stream.take_ffn(layer, j)  j < stream.ffn_chunks(layer); release()
    buf, counters = stream.attention(layer)          bytes valid until the next take
    for j, buf, counters in stream.head_chunks(name): the head's (or its sketch's) extents
    stream.skip_head(name) ... stream.drain_head()    a pass that needs none of them: unread

A pass takes its entries in schedule order. The position of a take is the next one at or after
the cursor that holds that entry, so a pass that was cut short (an error, a pass that did not
use the ring) simply starts the next lap, and the ring restarts there.
"""
from __future__ import annotations

from typing import Iterable, Optional

import numpy as np

from flashllm.ffi import kernel
from flashllm.ffi.reader import Reader, aligned_empty
from flashllm.format.reader import FlashModel
from flashllm.runtime.budget import RING_BUFFERS
from flashllm.runtime.interfaces import HeadChunks, ReadStream
from flashllm.runtime.layer import attn_names
from flashllm.runtime.weights import Extent, attention_extents, head_extents, head_tensor
from flashllm.storage.readahead import (Entry, ReadAhead, as_rows, block_step, page_chunks,
                                        page_step)

class PassStream(ReadStream):
    """The schedule of a static pass over a ring of buffers (n_buf, rows, stride) uint8: entries
    keyed ("attn", layer), ("ffn", layer, j) and ("head", j), in the order a pass takes them."""

    def __init__(self, buffers: np.ndarray, entries: list[Entry], ffn_chunks: list,
                 ffn_strides: list[int], head: list[Extent], head_matrix: str = ""):
        """ffn_chunks[layer] = [(first slot, n)]: a chunk of n slots fills n * its layer's
        stride bytes of a buffer; head: the extents of the matrix head_matrix (the head, or
        its sketch) the ("head", j) entries read."""
        self.buffers, self.entries = buffers, entries
        self._ffn, self._strides = ffn_chunks, ffn_strides
        self.head_extents, self.head_matrix = head, head_matrix
        self._pos = {e.key: p for p, e in enumerate(entries)}
        self._cursor = 0              # absolute schedule position of the next take
        self._held = False            # the last take is released by the next one
        self.ring: Optional[ReadAhead] = None

    @property
    def buffer_bytes(self) -> int:
        return self.buffers[0].nbytes

    def start(self) -> None:
        """Start reading ahead (once; the FFN calls it when its own reads through the FFN's
        reader, the pinned rows, are done: the ring may then use that reader alone)."""
        if self.ring is None:
            self.ring = ReadAhead(self.buffers, self.entries)

    # ---- what the consumers take -------------------------------------------------------------

    def ffn_chunks(self, layer: int) -> int:
        """How many FFN chunks layer has."""
        return len(self._ffn[layer])

    def take_ffn(self, layer: int, j: int) -> tuple[int, np.ndarray, dict]:
        """(first slot, its bundles (n, layer's stride), read counters) of layer's chunk j;
        release() when computed."""
        first, n = self._ffn[layer][j]
        rows, counters = self.take(("ffn", layer, j))                     # (m, stride)
        return first, as_rows(rows, n, self._strides[layer]), counters

    def attention(self, layer: int) -> Optional[tuple[np.ndarray, dict]]:
        """(bytes of layer's streamed attention (attention_extents), read counters), valid
        until the next take; None when the stream does not carry it."""
        if ("attn", layer) not in self._pos:
            return None
        rows, counters = self.take(("attn", layer), hold=False)          # (n, stride)
        return rows.reshape(-1), counters

    def head_chunks(self, name: str) -> Optional[HeadChunks]:
        """Iterator of (extent index, bytes (nbytes,), read counters) over the extents of the
        dense matrix `name`, each valid until the next; None when the stream carries no such
        head (another matrix's, or none)."""
        if not self.head_extents or name != self.head_matrix:
            return None
        return self._take_head()

    def skip_head(self, name: str) -> bool:
        """The next pass needs none of matrix `name`'s extents (a grammar allows few rows of the
        head, read on their own): the ring hands them over unread, and drain_head takes them.
        False when the stream does not carry that matrix or the ring is not running."""
        if not self.head_extents or name != self.head_matrix or self.ring is None:
            return False
        n = len(self.entries)
        at = [self._cursor + (self._pos[("head", j)] - self._cursor) % n
              for j in range(len(self.head_extents))]
        self.ring.skip(min(at), max(at) + 1)
        return True

    def drain_head(self) -> dict:
        """Take and release the head's extents of this pass unused (after skip_head); the
        counters of what was read all the same (a skip that came late), summed."""
        total: dict = {}
        for _, _, counters in self._take_head():
            for k, v in counters.items():
                total[k] = total.get(k, 0) + v
        return total

    def _take_head(self) -> HeadChunks:
        for j, (_, nbytes, lead) in enumerate(self.head_extents):
            rows, counters = self.take(("head", j))                        # (n, stride)
            counters = {**counters, "bytes_requested": max(counters["bytes_requested"] - lead,
                                                           0)}   # (0: skipped) as
            # the reader's own rounding to pages, the lead is not counted
            try:
                yield j, rows.reshape(-1)[lead:nbytes], counters
            finally:
                self.release()

    # ---- the ring ----------------------------------------------------------------------------

    def take(self, key, hold: bool = True) -> tuple[np.ndarray, dict]:
        """(rows (n, stride) of entry key, the counters of its read); waits for the read.
        hold=False: no release() follows, the buffer is released by the next take."""
        self.start()
        if self._held:
            self.ring.release()
            self._held = False
        p, n = self._pos[key], len(self.entries)
        pos = self._cursor + (p - self._cursor) % n
        rows, counters = self.ring.take(pos)
        self._cursor, self._held = pos + 1, not hold
        return rows, counters

    def release(self) -> None:
        self.ring.release()

    def close(self) -> None:
        """Stop reading ahead and close the dense readers (the FFN's is the FFN's)."""
        if self.ring is not None:
            self.ring.close()
        self._held = False
        dense = {id(e.reader): e.reader for e in self.entries if e.key[0] != "ffn"}
        for r in dense.values():
            r.close()


def pass_stream(flash: FlashModel, reader: Reader, staging_rows: int, streamed: Iterable[str],
                slots: int, first: int, head: str = "",
                stage_bytes: int = 1 << 20) -> Optional[PassStream]:
    """The read stream of a static pass over slots 0 .. slots-1 of which the caches hold
    0 .. first-1: FFN chunks of one ring buffer (staging_rows bundle rows cut into RING_BUFFERS
    buffers, or 2), read through the FFN's reader; then the dense matrices `streamed` (a budget
    plan's) that each fit one buffer, read through a new reader of dense.bin (stage_bytes): the
    attention layers', and the output head's or, when head names it, that matrix's (its
    sketch) in its place. None when every slot is cached."""
    f = flash.ffn
    rows = 2 * max(1, staging_rows // 2)
    staging = aligned_empty(rows * f.stride).reshape(-1, f.stride)      # (rows, stride)
    n_buf = RING_BUFFERS if rows >= 2 * RING_BUFFERS else 2
    step = page_step(rows // n_buf, f.stride)                          # buffers start on a page
    block = kernel.ffn_block()                  # chunks start where the kernel's sums do
    chunks = [[(a, b - a) for a, b in page_chunks(f.layer_offsets[layer], s, first, slots,
                                                   block_step(step * f.stride // s, s, block))]
              for layer, s in enumerate(f.strides)]                    # [layer][j] = (first, n)
    if not any(chunks):
        return None
    buffers = staging[:n_buf * step].reshape(n_buf, step, f.stride)   # (n_buf, step, stride)
    ffn = [[Entry(("ffn", layer, j), -(-n * f.strides[layer] // f.stride), reader,
                  np.array([f.layer_offsets[layer] + a * f.strides[layer]]),
                  np.array([n * f.strides[layer]]), np.array([0]))
            for j, (a, n) in enumerate(layer_chunks)] for layer, layer_chunks in enumerate(chunks)]
    attention, extents = _dense_pieces(flash, frozenset(streamed), buffers[0].nbytes, head)
    dense = Reader(flash.dense_file, n_threads=reader.n_threads, stage_bytes=stage_bytes) \
        if attention or extents else None
    entries = []
    for layer, layer_entries in enumerate(ffn):
        if layer in attention:
            offsets, lengths, dst = attention[layer]
            entries.append(Entry(("attn", layer), -(-(dst[-1] + lengths[-1]) // f.stride), dense,
                                 np.array(offsets), np.array(lengths), np.array(dst)))
        entries += layer_entries
    entries += [Entry(("head", j), -(-nbytes // f.stride), dense, np.array([offset]),
                      np.array([nbytes]), np.array([0]))
                for j, (offset, nbytes, _) in enumerate(extents)]
    return PassStream(buffers, entries, chunks, list(f.strides), extents,
                      (head or head_tensor(flash)) if extents else "")


def _dense_pieces(flash: FlashModel, streamed: frozenset, buffer_bytes: int,
                  head: str) -> tuple[dict, list[Extent]]:
    """({layer: attention_extents} of the streamed attention layers, the streamed head's (or
    `head`'s) extents), or nothing when a piece does not fit one buffer (the dense weights then
    read them all themselves)."""
    layers = [i for i in range(flash.config.n_layers) if any(n in streamed for n in attn_names(i))]
    attention = {i: attention_extents(flash, i) for i in layers}
    extents = head_extents(flash, head or head_tensor(flash), buffer_bytes) \
        if head_tensor(flash) in streamed else []
    sizes = [d[-1] + n[-1] for _, n, d in attention.values()] + [n for _, n, _ in extents]
    if sizes and max(sizes) > buffer_bytes:
        return {}, []
    return attention, extents
