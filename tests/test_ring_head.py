"""The output head read through the FFN's read-ahead ring (runtime.stream_head) gives exactly the
logits of the head read by the dense weights themselves, over prefills and decodes; the ring's
buffers start on pages so its reads land in place."""
from __future__ import annotations

import numpy as np

from flashllm.bundle import open_flash
from flashllm.dense_stream import DenseWeights
from flashllm.ioreader import Reader
from flashllm.model import Model
from flashllm.runtime import stream_head
from flashllm.sparse_ffn import AllSlots
from test_dense_stream import write_model
from test_sparse_ffn import flash_ffn

STEPS = [[1, 5, 9], [4], [7], [2, 3, 8, 6], [11], [12], [13]]   # prefill, decodes, a chat turn


def model(path, cfg, head_in_ring: bool):
    """A flash model: static FFN ring, output head streamed (through the ring or not)."""
    flash, ffn = flash_ffn(path, AllSlots(cfg.n_ff), "64MiB", staging_rows=192, capacity=30,
                           n_pinned=10)
    weights = DenseWeights(flash, 1, {"output.weight"}, Reader(flash.dense_file, n_threads=2),
                           chunk_bytes=1)
    if head_in_ring:
        stream_head(flash, ffn, weights)
        assert weights.head_source is not None and len(ffn._head) == 2   # 128 + 22 rows
    return Model(flash, n_threads=1, n_ctx=32, ffn=ffn, weights=weights), ffn, weights


def test_head_through_the_ring_gives_the_same_logits(tmp_path):
    cfg = write_model(tmp_path / "m", True, "f32", tied=False)
    ring, ffn, w_ring = model(tmp_path / "m", cfg, True)
    own, ffn_own, w_own = model(tmp_path / "m", cfg, False)
    pos = 0
    for toks in STEPS:
        np.testing.assert_array_equal(ring.forward(np.array(toks), pos),
                                      own.forward(np.array(toks), pos))
        pos += len(toks)
    head = open_flash(tmp_path / "m").dense_entry("output.weight")["nbytes"]
    assert w_ring.bytes_read == w_own.bytes_read == len(STEPS) * head   # every pass reads it once
    assert w_ring.reader.stats().bytes_requested == 2 * head             # the two prefills
    assert ffn._head_reader.stats().bytes_requested >= 5 * head          # decodes (+ read-ahead)
    for f in (ffn, ffn_own):
        f.close()
    assert not ffn.ring.running


def test_the_head_falls_back_to_its_own_reads_when_the_ring_is_elsewhere(tmp_path):
    """The head asked for while the ring is not at it (here: stopped after the layers) is read
    by the dense weights themselves; the ring restarts on the next token."""
    cfg = write_model(tmp_path / "m", True, "f32", tied=False)
    ring, ffn, _ = model(tmp_path / "m", cfg, True)
    own, _, _ = model(tmp_path / "m", cfg, False)
    x = np.random.default_rng(0).standard_normal((1, cfg.d_model)).astype(np.float32)  # (1, d)
    for m in (ring, own):
        m.forward(np.array([1, 5]), 0)
        m.forward(np.array([4]), 2)
    ffn.ring.stop()
    assert ffn.head_chunks() is None
    np.testing.assert_array_equal(ring.w.output(x), own.w.output(x))
    np.testing.assert_array_equal(ring.forward(np.array([7]), 3), own.forward(np.array([7]), 3))
    assert ffn.ring.running
    ffn.close()


def test_ring_buffers_start_on_pages(tmp_path):
    cfg = write_model(tmp_path / "m", True, "f32", tied=False)
    _, ffn, _ = model(tmp_path / "m", cfg, True)
    stride = ffn.f.stride
    assert ffn.ring.buffers.shape[1] * stride % 4096 == 0
    assert all(b.ctypes.data % 4096 == 0 for b in ffn.ring.buffers)
    ffn.close()
