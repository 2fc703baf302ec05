"""The model's dense weights (embeddings, attention, output head), resident or streamed.

`DenseWeights` answers the three questions a forward pass asks of them:

    embed(tokens)  (T, embed_dim)   rows of token_embd: get_rows in DRAM, or those rows read from
                                    dense.bin (one small read per distinct row)
    layer(i)       Layer            attention matrices in DRAM, or read per layer into one of two
                                    reused aligned buffers while the previous layer computes
    output(x)      (T, vocab)       the head in DRAM, or read in row chunks (double-buffered) and
                                    multiplied chunk by chunk

Vectors (norms, biases) are always resident. Which matrices stream is the budget plan's decision
(budget.py: `BudgetPlan.streamed`); reads go through the direct-I/O Reader (ffi/reader.py), or,
when the FFN's reads are static, come from the pass's read stream it is built with
(runtime/stream.py: the attention layers and the head it carries).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Iterable, Optional

import numpy as np

from flashllm.ffi import kernel
from flashllm.ffi.heap import trim_heap
from flashllm.ffi.quant import dequantize_rows
from flashllm.format.layout import SKETCH
from flashllm.format.reader import FlashModel, as_tensor
from flashllm.model.tensor import QTensor
from flashllm.model.archs.tensors import BY_FIELD
from flashllm.runtime.interfaces import DenseSource, HeadChunks, ReadStream
from flashllm.runtime.layer import Layer, attn_names, fuse_qkv, load_layer, opt_tensor
from flashllm.units import PAGE

if TYPE_CHECKING:     # the reader's module loads with the first one, after a run's plan
    from flashllm.ffi.reader import Reader

CHUNK_BYTES = 4 << 20          # rows of the streamed output head read at once (per buffer)
ROW_GROUP = 64                 # head chunks start at multiples of this many rows: the matmul kernel
                               # sums row tiles (native/ops.c TILE 4) alike only when aligned
Extent = tuple[int, int, int]  # (file offset, nbytes, lead): a head piece (head_extents)


def aligned_offsets(sizes: Iterable[int]) -> tuple[list[int], int]:
    """Offsets of consecutive pieces each starting on a 4096-byte boundary, and the total."""
    offs, end = [], 0
    for n in sizes:
        offs.append(end)
        end += -(-int(n) // PAGE) * PAGE
    return offs, end


def attention_extents(flash: FlashModel, i: int) -> tuple[list[int], list[int], list[int]]:
    """(file offsets, lengths, destination offsets) of layer i's attention matrices in one
    buffer, each on a page (aligned_offsets): what a streamed layer's bytes hold."""
    entries = [flash.dense_entry(n) for n in attn_names(i)]
    dst, _ = aligned_offsets(e["nbytes"] for e in entries)
    return [e["offset"] for e in entries], [e["nbytes"] for e in entries], dst


def head_extents(flash: FlashModel, name: str, max_bytes: int) -> list[Extent]:
    """The dense matrix `name` (the output head, or its sketch) as (file offset, nbytes, lead)
    pieces, in order: each reads nbytes <= max_bytes from a page-aligned offset, and its whole
    ROW_GROUPs of rows (at least one) are bytes [lead, nbytes) of what it read. (Aligned, a
    piece lands in its buffer by direct I/O page for page instead of through the reader's
    staging copy, which competes for the cores.)"""
    t = flash.dense_entry(name)
    rows = t["shape"][0]
    rb = t["nbytes"] // rows
    out, r0 = [], 0
    while r0 < rows:
        start = t["offset"] + r0 * rb
        lead = start % PAGE
        step = max(ROW_GROUP, (max_bytes - lead) // rb // ROW_GROUP * ROW_GROUP)
        out.append((start - lead, lead + (min(r0 + step, rows) - r0) * rb, lead))
        r0 += step
    return out


def head_tensor(flash: FlashModel) -> str:
    """The output head's tensor: output.weight, or token_embd.weight when tied."""
    return "output.weight" if flash.has("output.weight") else "token_embd.weight"


class DenseWeights(DenseSource):
    """The dense weights of a forward pass; `streamed` names the matrices read per use."""

    def __init__(self, flash: FlashModel, n_threads: int = 1, streamed: Iterable[str] = (),
                 reader: Optional[Reader] = None, chunk_bytes: int = CHUNK_BYTES,
                 pack: bool = False, stream: Optional[ReadStream] = None):
        """pack: resident attention matrices repacked for this build's matmul (kernel.pack;
        then no exact matmul reaches them). stream: a static pass's read stream, which reads
        the streamed attention layers and head it carries (the reader reads the rest)."""
        cfg = flash.config
        self.flash, self.n_threads, self.chunk_bytes = flash, n_threads, chunk_bytes
        self.streamed = frozenset(streamed)
        self.reader, self.stream = reader, stream
        self.head_name = head_tensor(flash)
        self.tied = self.head_name == "token_embd.weight"
        own = {f: opt_tensor(flash, BY_FIELD[f].at()) for f in ("pos_embd", "proj_in", "proj_out",
                                                               "out_norm", "out_norm_b")}
        self.pos_embd = own["pos_embd"]                                  # QTensor (n_pos, d_model)
        self.proj_in = own["proj_in"]                                    # QTensor (d_model, embed_dim)
        self.proj_out = own["proj_out"]                                  # QTensor (embed_dim, d_model)
        self.out_norm = flash.tensor(BY_FIELD["out_norm"].at())          # (d_model,)
        self.out_norm_b = own["out_norm_b"]                              # (d_model,)
        self.token_embd = self._resident("token_embd.weight")            # QTensor (vocab, embed_dim)
        self.head = (self.token_embd if self.tied else self._resident("output.weight"))
        if pack and self.head is not None and (not self.tied or kernel.unpacks(
                self.head.dtype, self.head.rows, self.head.cols)):
            self.head = kernel.pack(self.head, in_place=True) or self.head  # q6_k / q8_0 in place
            if self.tied and self.head is not self.token_embd:   # embed() unpacks its rows
                self.token_embd = None
                trim_heap()                  # q4_k's rows (a new array) returned at once
        self.layers = [self._load_layer(i, pack) for i in range(cfg.n_layers)]
        self._layer_bufs = self._buffers(max((self._layer_span(i)[1] for i in self._stream_layers()),
                                             default=0))
        chunk = 0 if self.head is not None else max(
            n for name in ("", SKETCH) if not name or flash.has(name)
            for _, n, _ in head_extents(flash, name or self.head_name, chunk_bytes))  # or sketch's
        self._head_bufs = self._buffers(chunk)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="flashllm-dense") \
            if self.streamed else None
        self._pending = None          # (layer, buffer index, future) of the prefetched layer
        self.bytes_read, self.read_seconds, self.ring_idle = 0, 0.0, 0.0

    def _load_layer(self, i: int, pack: bool) -> Layer:
        """Layer i: its resident matrices read (and packed: the read copies freed and their heap
        pages returned at once, or they would stay resident where no plan counts them)."""
        if not self._layer_resident(i):
            return load_layer(self.flash, i, [None] * 4)
        L = fuse_qkv(load_layer(self.flash, i))
        if not pack:
            return L
        L = replace(L, **{n: kernel.pack(w, in_place=True) or w for n, w in L.matrices().items()})
        trim_heap()
        return L

    # ---- what the forward pass asks ---------------------------------------------------------

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """(T, embed_dim) f32 embedding rows of tokens (T,): a tied head packed for the matmul
        gives its rows unpacked, a streamed token_embd its rows read."""
        if self.token_embd is not None:
            return kernel.get_rows(self.token_embd, tokens)               # (T, embed_dim)
        uniq, inverse = np.unique(tokens, return_inverse=True)           # (U,) (T,)
        if self.tied and self.head is not None:
            sub = kernel.unpack_rows(self.head, uniq)                     # QTensor (U, embed_dim)
        else:
            t = self.flash.dense_entry("token_embd.weight")
            rows, cols = t["shape"]
            buf = np.empty((len(uniq), t["nbytes"] // rows), dtype=np.uint8)  # (U, row_bytes)
            self.read_rows("token_embd.weight", uniq, buf)
            sub = QTensor(buf, t["dtype"], len(uniq), cols)
        return kernel.get_rows(sub, inverse.astype(np.int32))             # (T, embed_dim)

    def read_rows(self, name: str, ids: np.ndarray, out: np.ndarray) -> None:
        """Rows ids (k,) of the streamed matrix `name` → out (k, row bytes) uint8, read from
        dense.bin now (direct I/O, on the reader's thread; counted in the dense stats)."""
        t = self.flash.dense_entry(name)
        rb = t["nbytes"] // t["shape"][0]
        ids = np.asarray(ids, dtype=np.int64)                            # (k,)
        self._pool.submit(self._read, t["offset"] + ids * rb, np.full(len(ids), rb),
                          out.reshape(-1), np.arange(len(ids), dtype=np.int64) * rb).result()

    def layer(self, i: int) -> Layer:
        """Layer i's weights; streamed matrices are valid until the next call."""
        L = self.layers[i]
        if self._layer_resident(i):
            return L
        got = self.stream.attention(i) if self.stream is not None else None
        if got is not None:
            buf, counters = got
            self.count(counters)
            return self._with_matrices(L, self._views(i, buf))
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == i:
            k = pending[1]
            pending[2].result()
        else:
            if pending is not None:
                pending[2].result()
            k = 0 if pending is None else 1 - pending[1]
            self._read_layer(i, k)
        nxt = self._next_streamed(i)
        self._pending = (nxt, 1 - k, self._pool.submit(self._read_layer, nxt, 1 - k))
        return self._with_matrices(L, self._views(i, self._layer_bufs[k]))

    def resident_layer(self, i: int) -> Optional[Layer]:
        """Layer i when its matrices stay in DRAM (the same object every call), else None;
        nothing is read."""
        return self.layers[i] if self._layer_resident(i) else None

    @staticmethod
    def _with_matrices(L: Layer, matrices: list) -> Layer:
        wq, wk, wv, wo = matrices
        return replace(L, wq=wq, wk=wk, wv=wv, wo=wo)

    def streamed_layers(self) -> list[int]:
        """The layers whose attention matrices stream."""
        return self._stream_layers()

    def output(self, x: np.ndarray, exact: bool = False) -> np.ndarray:
        """(T, vocab) f32 logits of the normalized final hidden states x (T, embed_dim); exact:
        q4_0 / q8_0 rows multiply f32 activations instead of int8 ones."""
        if self.head is not None:
            return kernel.matmul(self.head, x, None, self.n_threads, exact)  # (T, vocab)
        chunks = self.stream.head_chunks(self.head_name) if self.stream is not None else None
        if chunks is not None:
            return self._output_of(chunks, x, exact)
        return self._output_of(self._own_head_chunks(), x, exact)

    def head_columns(self, dims: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The head's columns dims (k,), dequantized: (k, vocab) f16, and each one's largest
        |value| (k,) f32 before the rounding to f16; a streamed head is read whole once (counted
        in the dense stats). Filled 64 rows at a time: no (vocab, k) f32 temporary, which a
        budget's plan does not hold (it counts the f16 columns)."""
        t = self.flash.dense_entry(self.head_name)
        rows, cols = t["shape"]
        rb = t["nbytes"] // rows
        if len(dims) == 0:                     # no dim stood out: nothing to read
            return np.empty((0, rows), np.float16), np.zeros(0, np.float32)
        if self.head is not None:              # its rows as on file (a packed head's are not)
            whole = self.head.data if isinstance(self.head, QTensor) else \
                self.flash.tensor(self.head_name).data                  # (vocab, row bytes)
            chunks = ((j, whole[r:r + ROW_GROUP * 64].reshape(-1), None)
                      for j, r in enumerate(range(0, rows, ROW_GROUP * 64)))
        else:
            chunks = self._own_head_chunks()
        out = np.empty((len(dims), rows), np.float16)                    # (k, vocab)
        top = np.zeros(len(dims), np.float32)                            # (k,)
        r0 = 0
        for _, buf, _ in chunks:
            data = buf.reshape(-1, rb)                                   # (n, row_bytes)
            for r in range(0, len(data), 64):    # 64 rows at a time: small temporaries under a cap
                part = dequantize_rows(data[r:r + 64], t["dtype"], cols)[:, dims]  # (<= 64, k)
                out[:, r0:r0 + len(part)] = part.T
                np.maximum(top, np.abs(part).max(axis=0), out=top)
                r0 += len(part)
        if r0 != rows:
            raise RuntimeError(f"the head's columns came from {r0} of its {rows} rows")
        return out, top

    def sketch_output(self, x: np.ndarray, chunks: Optional[HeadChunks] = None) -> np.ndarray:
        """(T, vocab) logits of x (T, d_pad) by the head's streamed sketch (SKETCH): its chunks
        (a read stream's: SparseHead), else read here."""
        return self._output_of(chunks or self._own_head_chunks(SKETCH), x, False, SKETCH)

    def _own_head_chunks(self, name: str = "") -> HeadChunks:
        """The head's (or matrix name's) extents (head_extents(chunk_bytes)) read by this object's
        reader into its two head buffers, extent j + 1 while extent j computes; counters None
        (counted by _read)."""
        extents = head_extents(self.flash, name or self.head_name, self.chunk_bytes)
        off, nb, lead = extents[0]
        job = self._pool.submit(self._read, [off], [nb], self._head_bufs[0], [0], lead)
        for j, (_, nbytes, lead) in enumerate(extents):
            job.result()
            if j + 1 < len(extents):
                off, nb, lead1 = extents[j + 1]
                job = self._pool.submit(self._read, [off], [nb], self._head_bufs[(j + 1) % 2], [0],
                                        lead1)
            yield j, self._head_bufs[j % 2][lead:nbytes], None

    def _output_of(self, chunks, x: np.ndarray, exact: bool, name: str = "") -> np.ndarray:
        """(T, vocab) logits from head (or matrix name's) chunks: (extent index, bytes (nbytes,),
        read counters or None when already counted) over head_extents in order."""
        t = self.flash.dense_entry(name or self.head_name)
        rows, cols = t["shape"]
        rb = t["nbytes"] // rows
        logits = np.empty((len(x), rows), dtype=np.float32)               # (T, vocab)
        r0 = 0
        for _, buf, counters in chunks:
            n = len(buf) // rb
            w = QTensor(buf.reshape(n, rb), t["dtype"], n, cols)
            logits[:, r0:r0 + n] = kernel.matmul(w, x, None, self.n_threads, exact)  # (T, n)
            if counters is not None:
                self.count(counters)
            r0 += n
        if r0 != rows:
            raise RuntimeError(f"the streamed head came in {r0} of its {rows} rows")
        return logits

    def stats(self) -> dict:
        return {"dense_streamed": sorted(self.streamed), "dense_bytes_read": self.bytes_read,
                "dense_read_s": self.read_seconds, "dense_ring_idle_s": self.ring_idle}

    def count(self, counters: dict) -> None:
        """Counters of a read the FFN's read-ahead ring made for these weights."""
        self.bytes_read += counters["bytes_requested"]
        self.read_seconds += counters["read_s"]
        self.ring_idle += counters.get("ring_idle_s", 0.0)

    # ---- reads ------------------------------------------------------------------------------

    def _resident(self, name: str):
        return None if name in self.streamed else self.flash.tensor(name)

    def _layer_resident(self, i: int) -> bool:
        return not any(n in self.streamed for n in attn_names(i))

    def _stream_layers(self) -> list[int]:
        return [i for i in range(len(self.layers)) if not self._layer_resident(i)]

    def _next_streamed(self, i: int) -> int:
        """The streamed layer after i, wrapping to the first (the next token's)."""
        s = self._stream_layers()
        later = [j for j in s if j > i]
        return later[0] if later else s[0]

    def _layer_span(self, i: int) -> tuple[list[int], int]:
        return aligned_offsets(self.flash.dense_entry(n)["nbytes"] for n in attn_names(i))

    def _buffers(self, nbytes: int) -> list[np.ndarray]:
        """Two 4096-aligned buffers (double buffering); none when nothing streams there."""
        from flashllm.ffi.reader import aligned_empty
        return [aligned_empty(-(-nbytes // PAGE) * PAGE) for _ in range(2)] if nbytes else []

    def _read(self, offsets, lengths, dst: np.ndarray, dst_offsets, padding: int = 0) -> None:
        """One batch of reads; only ever called on the pool's single thread. padding: bytes read
        only to align (not counted, as the reader's own rounding to pages is not)."""
        t0 = time.perf_counter()
        self.reader.read(np.asarray(offsets, np.int64), np.asarray(lengths, np.int64), dst,
                         np.asarray(dst_offsets, np.int64))
        self.read_seconds += time.perf_counter() - t0
        self.bytes_read += int(np.sum(lengths)) - padding

    def _read_layer(self, i: int, k: int) -> None:
        offsets, lengths, dst = attention_extents(self.flash, i)
        self._read(offsets, lengths, self._layer_bufs[k], dst)

    def _views(self, i: int, buf: np.ndarray) -> list[QTensor]:
        """Layer i's attention matrices over buf (bytes laid out by attention_extents)."""
        dst, _ = self._layer_span(i)
        return [as_tensor(buf[o:o + e["nbytes"]], e) for o, e in
                zip(dst, (self.flash.dense_entry(n) for n in attn_names(i)))]

    def close(self) -> None:
        """Wait for the read in flight, then close the reader (it is this object's)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self.reader is not None:
            self.reader.close()
