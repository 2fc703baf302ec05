"""The read-ahead (C thread, native/readahead.c) against the file's bytes: chunks come back
in order and hold the right bytes across many laps of the schedule (from two readers), a consumer
that jumps restarts the ring at the right place, a read error reaches the consumer as the error,
and the counters of each take are its own read's."""
from __future__ import annotations

import numpy as np
import pytest

from flashllm.errors import KernelError
from flashllm.ffi.reader import Reader, aligned_empty
from flashllm.storage.readahead import Entry, ReadAhead

STRIDE = 4096 + 512          # a bundle that is not a page multiple


@pytest.fixture
def ffn_file(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 3 * 40 * STRIDE, dtype=np.uint8)  # 3 layers x 40
    path = tmp_path / "ffn.bin"
    data.tofile(path)
    return path, data.reshape(3, 40, STRIDE)                      # (layers, slots, stride)


def entry(reader, layer, first, n):
    off = (layer * 40 + first) * STRIDE
    return Entry((layer, first), n, reader, np.array([off]), np.array([n * STRIDE]), np.array([0]))


def make_ring(path, schedule, n_buf=3, rows=8):
    readers = [Reader(path, n_threads=2), Reader(path, n_threads=2)]
    buffers = aligned_empty(n_buf * rows * STRIDE).reshape(n_buf, rows, STRIDE)  # (n_buf, rows, stride)
    entries = [entry(readers[i % 2], *s) for i, s in enumerate(schedule)]     # alternate readers
    return ReadAhead(buffers, entries), readers


def close(ring, readers):
    ring.close()
    for r in readers:
        r.close()


def test_chunks_arrive_in_order_with_the_file_bytes(ffn_file):
    path, data = ffn_file
    schedule = [(layer, c, min(8, 40 - c)) for layer in range(3) for c in range(12, 40, 8)]
    ring, readers = make_ring(path, schedule)
    try:
        for pos in range(5 * len(schedule) + 3):                   # five laps and a bit
            layer, first, n = schedule[pos % len(schedule)]
            rows, counters = ring.take(pos)                        # (n, stride)
            assert rows.shape == (n, STRIDE) and counters["bytes_requested"] == n * STRIDE
            assert counters["reads"] >= 1 and counters["read_s"] > 0
            np.testing.assert_array_equal(rows, data[layer, first:first + n])
            ring.release()
        assert ring.running
        ring.stop()
        assert not ring.running
        assert sum(r.stats().bytes_requested for r in readers) >= \
            sum(n for *_, n in schedule) * STRIDE * 5              # read ahead: maybe more
    finally:
        close(ring, readers)


def test_a_jump_restarts_the_ring_where_asked(ffn_file):
    path, data = ffn_file
    schedule = [(layer, 0, 8) for layer in range(3)]
    ring, readers = make_ring(path, schedule)
    try:
        ring.take(0)
        ring.release()
        rows, _ = ring.take(7)                                     # skipped 1 .. 6 (layer 1 of lap 2)
        np.testing.assert_array_equal(rows, data[1, :8])
        ring.release()
        rows, _ = ring.take(8)
        np.testing.assert_array_equal(rows, data[2, :8])
        ring.release()
        rows, _ = ring.take(3)                                     # back: a restart too
        np.testing.assert_array_equal(rows, data[0, :8])
    finally:
        close(ring, readers)


def test_skipped_positions_are_handed_over_unread_in_place(ffn_file):
    """skip(a, b): positions a .. b-1 come back in order with zero counters and no read (the
    readers' byte counts say so), the ring keeps running (no restart), and the positions after
    them hold the file's bytes."""
    path, data = ffn_file
    schedule = [(layer, c, 8) for layer in range(3) for c in (0, 8)]     # 6 entries a lap
    ring, readers = make_ring(path, schedule, n_buf=2)
    try:
        ring.take(0)
        ring.skip(9, 11)                                           # lap 2: layer 1's two chunks
        ring.release()
        for pos in range(1, 18):
            layer, first, n = schedule[pos % len(schedule)]
            rows, counters = ring.take(pos)                        # (n, stride)
            if 9 <= pos < 11:
                assert counters["bytes_requested"] == 0 and counters["reads"] == 0
            else:
                assert counters["bytes_requested"] == n * STRIDE
                np.testing.assert_array_equal(rows, data[layer, first:first + n])
            ring.release()
            assert ring.running
        total = sum(r.stats().bytes_requested for r in readers)   # 16 taken, 2 unread,
        assert 16 * 8 * STRIDE <= total <= 18 * 8 * STRIDE           # at most 2 read ahead
    finally:
        close(ring, readers)


def test_a_consumer_that_holds_every_buffer_stalls_only_the_reader(ffn_file):
    path, data = ffn_file
    schedule = [(layer, 0, 8) for layer in range(3)]
    ring, readers = make_ring(path, schedule, n_buf=2)
    try:
        a, _ = ring.take(0)
        b, _ = ring.take(1)                                        # both buffers held
        np.testing.assert_array_equal(a, data[0, :8])
        np.testing.assert_array_equal(b, data[1, :8])
        ring.release()
        ring.release()
        rows, _ = ring.take(2)
        np.testing.assert_array_equal(rows, data[2, :8])
    finally:
        close(ring, readers)


def test_a_read_error_is_raised_by_take(ffn_file):
    path, _ = ffn_file
    ring, readers = make_ring(path, [(0, 0, 8), (5, 0, 8)])       # layer 5 is past the end
    try:
        ring.take(0)
        ring.release()
        with pytest.raises(KernelError, match="outside the file"):
            ring.take(1)
        assert not ring.running
    finally:
        close(ring, readers)


def test_bad_rings_are_refused(ffn_file):
    path, _ = ffn_file
    with pytest.raises(KernelError, match="fit one read-ahead buffer"):
        make_ring(path, [(0, 0, 9)], rows=8)
    with pytest.raises(KernelError, match="at least two"):
        make_ring(path, [(0, 0, 8)], n_buf=1)
    reader = Reader(path, n_threads=1)
    buffers = aligned_empty(2 * 8 * STRIDE).reshape(2, 8, STRIDE)  # (2, 8, stride)
    bad = Entry("x", 1, reader, np.array([0]), np.array([STRIDE]), np.array([8 * STRIDE - 1]))
    with pytest.raises(KernelError, match="fit one read-ahead buffer"):
        ReadAhead(buffers, [bad])                                   # a request past its buffer
    reader.close()
