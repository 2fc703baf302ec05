"""The read-ahead ring against plain Python reads of the same file: chunks come back in order
and hold the right bytes across many laps of the schedule, a consumer that jumps restarts the
ring at the right place, and a read error reaches the consumer as the error."""
from __future__ import annotations

import numpy as np
import pytest

from flashllm.errors import KernelError
from flashllm.ioreader import Reader, aligned_empty
from flashllm.read_ring import ReadRing

STRIDE = 4096 + 512          # a bundle that is not a page multiple


@pytest.fixture
def ffn_file(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 3 * 40 * STRIDE, dtype=np.uint8)  # 3 layers x 40
    path = tmp_path / "ffn.bin"
    data.tofile(path)
    return path, data.reshape(3, 40, STRIDE)                      # (layers, slots, stride)


def make_ring(path, schedule, n_buf=3, rows=8, reads=None):
    reader = Reader(path, n_threads=2)
    buffers = aligned_empty(n_buf * rows * STRIDE).reshape(n_buf, rows, STRIDE)  # (n_buf, rows, stride)

    def read(layer, first, n, out):
        off = (layer * 40 + first) * STRIDE
        reader.read(np.array([off]), np.array([n * STRIDE]), out.reshape(-1), np.array([0]))
        if reads is not None:
            reads.append((layer, first, n))
        return n
    return ReadRing(buffers, schedule, read), reader


def test_chunks_arrive_in_order_with_the_file_bytes(ffn_file):
    path, data = ffn_file
    schedule = [(layer, c, min(8, 40 - c)) for layer in range(3) for c in range(12, 40, 8)]
    ring, reader = make_ring(path, schedule)
    try:
        for pos in range(5 * len(schedule) + 3):                   # five laps and a bit
            layer, first, n = schedule[pos % len(schedule)]
            rows, counters = ring.take(pos)                        # (n, stride)
            assert counters == n and rows.shape == (n, STRIDE)
            np.testing.assert_array_equal(rows, data[layer, first:first + n])
            ring.release()
    finally:
        ring.stop()
        reader.close()
    assert not ring.running


def test_a_jump_restarts_the_ring_where_asked(ffn_file):
    path, data = ffn_file
    schedule = [(layer, 0, 8) for layer in range(3)]
    reads = []
    ring, reader = make_ring(path, schedule, reads=reads)
    try:
        ring.take(0)
        ring.release()
        rows, _ = ring.take(7)                                     # skipped 1 .. 6 (layer 1 of lap 2)
        np.testing.assert_array_equal(rows, data[1, :8])
        ring.release()
        rows, _ = ring.take(8)
        np.testing.assert_array_equal(rows, data[2, :8])
        ring.release()
    finally:
        ring.stop()
        reader.close()
    assert reads[0] == (0, 0, 8) and (1, 0, 8) in reads[1:]


def test_a_read_error_is_raised_by_take(ffn_file):
    path, _ = ffn_file
    ring, reader = make_ring(path, [(0, 0, 8), (5, 0, 8)])        # layer 5 is past the end
    try:
        ring.take(0)
        ring.release()
        with pytest.raises(KernelError, match="outside the file"):
            ring.take(1)
        assert not ring.running
    finally:
        ring.stop()
        reader.close()


def test_bad_rings_are_refused(ffn_file):
    path, _ = ffn_file
    with pytest.raises(ValueError, match="fit one ring buffer"):
        make_ring(path, [(0, 0, 9)], rows=8)
    with pytest.raises(ValueError, match="at least two"):
        make_ring(path, [(0, 0, 8)], n_buf=1)
