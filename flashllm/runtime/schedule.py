"""The schedule of a static forward pass: everything it reads, in the order it uses it, read
ahead by one ReadAhead (flashllm/storage/readahead.py).

Why and when: docs/ARCHITECTURE.md, "The read-ahead". The schedule: for each layer its streamed
attention matrices (one entry), then its FFN chunks; after the last layer the streamed output
head, in extents. The read-ahead reads it over and over, across layers and passes.

    schedule = PassSchedule(buffers, ffn_chunks, ffn_request)  ffn_chunks[layer] = [(first slot, n)]
    schedule.add_dense(attention, head)                      streamed dense weights join
    rows, counters = schedule.take(("ffn", layer, j))        buffer rows holding chunk j
    ... compute ...; schedule.release()
    buf, counters = schedule.take(("attn", layer), hold=False)  bytes valid until the next take

A pass takes its entries in schedule order. The position of a take is the next one at or after
the cursor that holds that entry, so a pass that was cut short (an error, a pass that did not
use the ring) simply starts the next lap, and the ring restarts there.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from flashllm.storage.readahead import Entry, ReadAhead

# ffn_request(layer, first slot, n slots) -> (reader, offsets (m,), lengths (m,), dst offsets (m,))
FfnRequest = Callable[[int, int, int], tuple]


class PassSchedule:
    """The schedule of a static pass over a ring of buffers (n_buf, rows, stride) uint8."""

    def __init__(self, buffers: np.ndarray, ffn_chunks: list, ffn_request: FfnRequest,
                 ffn_strides: Optional[list] = None):
        """ffn_strides: each layer's bundle stride (default: the buffers' row); a chunk of n
        slots fills n * its stride bytes of a buffer, take() gives whole buffer rows."""
        self.buffers, self._ffn, self._ffn_request = buffers, ffn_chunks, ffn_request
        self._strides = ffn_strides or [buffers.shape[2]] * len(ffn_chunks)
        self._attn: dict = {}         # layer -> (reader, offsets (4,), lengths (4,), dst (4,))
        self._head: tuple = (None, [])   # (reader, [(offset, nbytes, lead)])
        self._cursor = 0              # absolute schedule position of the next take
        self._held = False            # the last take is released by the next one
        self.ring = self._build()

    @property
    def buffer_bytes(self) -> int:
        return self.buffers[0].nbytes

    def add_dense(self, attention: dict, head: tuple) -> None:
        """Streamed dense weights join the schedule: attention {layer: (reader, offsets,
        lengths, dst offsets)} (one entry before the layer's FFN chunks) and head (reader,
        [(offset, nbytes, lead)]: DenseWeights.head_extents) after the last layer; each piece
        must fit one buffer."""
        self._close_ring()
        self._attn, self._head = dict(attention), (head[0], list(head[1]))
        self.ring = self._build()

    @property
    def head_extents(self) -> list:
        return self._head[1]

    def has_attention(self, layer: int) -> bool:
        return layer in self._attn

    def ffn_keys(self, layer: int) -> list:
        """The keys of layer's FFN chunks, in order."""
        return [("ffn", layer, j) for j in range(len(self._ffn[layer]))]

    def chunk(self, key) -> tuple[int, int]:
        """(first slot, n slots) of an FFN chunk key."""
        return self._ffn[key[1]][key[2]]

    def take(self, key, hold: bool = True):
        """(rows (n, stride) of entry key, the counters of its read); waits for the read.
        hold=False: no release() follows, the buffer is released by the next take."""
        if self._held:
            self.ring.release()
            self._held = False
        p, n = self._pos[key], len(self.ring.schedule)
        pos = self._cursor + (p - self._cursor) % n
        rows, counters = self.ring.take(pos)
        self._cursor, self._held = pos + 1, not hold
        return rows, counters

    def release(self) -> None:
        self.ring.release()

    def close(self) -> None:
        self._close_ring()
        readers = {id(r): r for r, *_ in self._attn.values()}
        if self._head[0] is not None:
            readers[id(self._head[0])] = self._head[0]
        for r in readers.values():
            r.close()

    def _close_ring(self) -> None:
        if self.ring is not None:
            self.ring.close()
        self._held = False

    def _build(self) -> Optional[ReadAhead]:
        stride = self.buffers.shape[2]
        rows = lambda nbytes: -(-int(nbytes) // stride)
        entries = []
        for layer, chunks in enumerate(self._ffn):
            if layer in self._attn:
                reader, offsets, lengths, dst = self._attn[layer]
                entries.append(Entry(("attn", layer), rows(dst[-1] + lengths[-1]), reader,
                                     offsets, lengths, dst))
            entries += [Entry(("ffn", layer, j), rows(n * self._strides[layer]),
                              *self._ffn_request(layer, first, n))
                        for j, (first, n) in enumerate(chunks)]
        reader = self._head[0]
        entries += [Entry(("head", j), rows(nbytes), reader, np.array([offset]),
                          np.array([nbytes]), np.array([0]))
                    for j, (offset, nbytes, _) in enumerate(self._head[1])]
        self._pos = {e.key: p for p, e in enumerate(entries)}
        return ReadAhead(self.buffers, entries) if entries else None
