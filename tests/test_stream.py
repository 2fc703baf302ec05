"""Streamed attention and output head read through a static pass's read stream (runtime/stream.py,
built before the FFN and the dense weights that take from it) give exactly the logits of the
dense weights reading them themselves, over prefills and decodes, and after a pass cut short; the
ring's buffers start on pages so its reads land in place."""
from __future__ import annotations

import numpy as np
import pytest

from flashllm.format.reader import open_flash
from flashllm.runtime.layer import attn_names
from flashllm.runtime.weights import DenseWeights
from flashllm.ffi.reader import Reader
from flashllm.runtime.model import Model
from flashllm.sparsity.predictor import AllSlots
from test_dense_stream import write_model
from test_sparse_ffn import flash_ffn

STEPS = [[1, 5, 9], [4], [7], [2, 3, 8, 6], [11], [12], [13]]   # prefill, decodes, a chat turn
HEAD_ONLY = ({"output.weight"}, 192)            # 36 KiB ring buffers: the head in 2 extents
HEAD_ATTN = ({"output.weight", *attn_names(1)}, 256)   # 48 KiB: layer 1's attention fits one


def model(path, cfg, streamed, staging_rows, in_ring: bool):
    """A flash model whose FFN reads are static (ring), with `streamed` dense weights read
    through the ring (in_ring) or by the dense weights themselves."""
    flash, ffn = flash_ffn(path, AllSlots(cfg.n_ff), "64MiB", staging_rows=staging_rows,
                           capacity=30, n_pinned=10, streamed=streamed if in_ring else ())
    weights = DenseWeights(flash, 1, streamed, Reader(flash.dense_file, n_threads=2),
                           chunk_bytes=1, stream=ffn.stream)
    assert (ffn.stream.head_chunks("output.weight") is not None) == in_ring
    return Model(flash, n_threads=1, n_ctx=32, ffn=ffn, weights=weights), ffn, weights


@pytest.mark.parametrize("streamed, staging_rows", [HEAD_ONLY, HEAD_ATTN])
def test_dense_reads_through_the_ring_give_the_same_logits(tmp_path, streamed, staging_rows):
    cfg = write_model(tmp_path / "m", True, "f32", tied=False)
    ring, ffn, w_ring = model(tmp_path / "m", cfg, streamed, staging_rows, True)
    own, ffn_own, _ = model(tmp_path / "m", cfg, streamed, staging_rows, False)
    assert len(ffn.stream.head_extents) == 2        # page-aligned pieces: both rings take 2
    pos = 0
    for toks in STEPS:
        np.testing.assert_array_equal(ring.forward(np.array(toks), pos),
                                      own.forward(np.array(toks), pos))
        pos += len(toks)
    flash = open_flash(tmp_path / "m")
    per_pass = sum(flash.dense_entry(n)["nbytes"] for n in streamed)
    assert w_ring.bytes_read == len(STEPS) * per_pass                  # every pass, once
    assert w_ring.reader.stats().bytes_requested == 0                  # all through the ring
    for f in (ffn, ffn_own):
        f.close()
    assert not ffn.stream.ring.running


def test_a_pass_cut_short_restarts_the_ring_at_the_next_pass(tmp_path):
    cfg = write_model(tmp_path / "m", True, "f32", tied=False)
    ring, ffn, _ = model(tmp_path / "m", cfg, *HEAD_ATTN, True)
    own, _, _ = model(tmp_path / "m", cfg, *HEAD_ATTN, False)
    for m in (ring, own):
        m.forward(np.array([1, 5]), 0)
    ffn.stream.take_ffn(0, 0)               # a pass that stops after its first chunk
    ffn.stream.release()
    np.testing.assert_array_equal(ring.forward(np.array([4]), 2), own.forward(np.array([4]), 2))
    ffn.stream.ring.stop()                  # the read-ahead stopped between passes
    np.testing.assert_array_equal(ring.forward(np.array([7]), 3), own.forward(np.array([7]), 3))
    assert ffn.stream.ring.running
    ffn.close()


def test_ring_buffers_start_on_pages(tmp_path):
    cfg = write_model(tmp_path / "m", True, "f32", tied=False)
    _, ffn, _ = model(tmp_path / "m", cfg, *HEAD_ONLY, True)
    assert ffn.stream.buffers.shape[1] * ffn.f.stride % 4096 == 0
    assert all(b.ctypes.data % 4096 == 0 for b in ffn.stream.buffers)
    ffn.close()
