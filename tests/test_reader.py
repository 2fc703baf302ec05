"""The direct-I/O reader against plain Python reads of the same bytes."""
import ctypes
import mmap
import os
import warnings

import numpy as np
import pytest

from flashllm.errors import KernelError
from flashllm.units import PAGE
from flashllm.ffi.reader import DirectIOWarning, Reader, aligned_empty, plan_reads

FILE_BYTES = 2 * 1024 * 1024 + 777  # not a multiple of the page: the tail bundle is unaligned


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reader") / "data.bin"
    data = np.random.default_rng(7).integers(0, 256, FILE_BYTES, dtype=np.uint8)  # (FILE_BYTES,)
    path.write_bytes(data.tobytes())
    return path


def python_read(path, offset, length):
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def random_batch(rng, n, stride=None):
    """Offsets and lengths of n requests: fixed-stride bundles or arbitrary ranges."""
    if stride:
        ids = np.sort(rng.choice(FILE_BYTES // stride, size=n, replace=False))  # (n,)
        return ids * stride, np.full(n, stride)
    lengths = rng.integers(0, 200_000, n)  # (n,)
    return rng.integers(0, FILE_BYTES - lengths + 1), lengths


@pytest.mark.parametrize("ring", [True, False], ids=["io_uring", "pool"])
@pytest.mark.parametrize("threads", [1, 4, 16])
@pytest.mark.parametrize("stride", [None, 1536, 2624, 4096])
def test_random_batches_match_python_reads(data_file, threads, stride, ring):
    rng = np.random.default_rng(threads * 1000 + (stride or 0))
    with Reader(data_file, n_threads=threads, ring=ring) as reader:
        assert ring or not reader.ring
        for trial in range(6):
            offsets, lengths = random_batch(rng, int(rng.integers(1, 300)), stride)  # (n,) (n,)
            offsets[-1] = FILE_BYTES - lengths[-1]  # the unaligned tail
            dst_offsets = np.concatenate([[0], np.cumsum(lengths + 8)[:-1]])  # (n,) unaligned slots
            dst = aligned_empty(int(dst_offsets[-1] + lengths[-1]) + 8)  # (total,)
            max_gap = int(rng.choice([-1, 0, 4096, 65536]))
            reader.read(offsets, lengths, dst, dst_offsets, max_gap=max_gap,
                        max_run=int(rng.choice([0, 8192, 131072])))
            for o, n, d in zip(offsets, lengths, dst_offsets):
                assert dst[d:d + n].tobytes() == python_read(data_file, o, n)


def test_io_uring_is_used_where_the_kernel_has_it(data_file):
    with Reader(data_file, n_threads=4) as reader:
        if not reader.ring:
            pytest.skip("this kernel refuses io_uring: the reader uses its thread pool")
        dst = aligned_empty(3 * PAGE)  # (3 pages,)
        reader.read(np.array([FILE_BYTES - 2 * PAGE - 5]), np.array([2 * PAGE + 5]), dst,
                    np.array([0]))  # the last read is short: it stops at the end of the file
        assert dst[:2 * PAGE + 5].tobytes() == python_read(data_file, FILE_BYTES - 2 * PAGE - 5,
                                                            2 * PAGE + 5)


def test_bundles_land_in_their_slots(data_file):
    stride = 1536
    ids = np.array([3, 4, 5, 90, 91, 700])  # (6,) sorted, neighbours and far ones
    slots = np.array([5, 0, 2, 1, 4, 3])  # (6,)
    out = np.zeros((8, stride), dtype=np.uint8)  # (capacity, stride)
    with Reader(data_file, n_threads=2) as reader:
        reader.read_bundles(4096, stride, ids, out, slots, max_gap=8192)
        stats = reader.stats()
    for i, s in zip(ids, slots):
        assert out[s].tobytes() == python_read(data_file, 4096 + i * stride, stride)
    assert (stats.merged_requests, stats.reads) == (3, 3)  # 3-4-5 and 90-91 share reads


def test_gaps_are_read_only_when_allowed(data_file):
    offsets = np.arange(0, 64) * 3 * PAGE  # (64,) one page used, two skipped
    lengths = np.full(64, PAGE)  # (64,)
    assert plan_reads(offsets, lengths, max_gap=-1) == (64, 64 * PAGE, 0)
    assert plan_reads(offsets, lengths, max_gap=PAGE) == (64, 64 * PAGE, 0)
    reads, nbytes, gaps = plan_reads(offsets, lengths, max_gap=2 * PAGE, max_run=1 << 20)
    assert (reads, gaps) == (1, 63 * 2 * PAGE) and nbytes == 190 * PAGE
    dst = aligned_empty(64 * PAGE)  # (64 pages,)
    with Reader(data_file, n_threads=4) as reader:
        reader.read(offsets, lengths, dst, np.arange(64) * PAGE, max_gap=2 * PAGE)
        stats = reader.stats()
    assert (stats.reads, stats.gap_bytes, stats.merged_requests) == (1, 63 * 2 * PAGE, 63)
    assert dst[5 * PAGE:6 * PAGE].tobytes() == python_read(data_file, 15 * PAGE, PAGE)


def test_request_past_end_of_file_is_a_clear_error(data_file):
    dst = aligned_empty(2 * PAGE)
    with Reader(data_file, n_threads=2) as reader:
        with pytest.raises(KernelError, match=r"request 1 \(offset .*outside the file"):
            reader.read(np.array([0, FILE_BYTES - 100]), np.array([100, 101]), dst,
                        np.array([0, PAGE]))
        with pytest.raises(KernelError, match="too small"):
            reader.read(np.array([0]), np.array([3 * PAGE]), dst, np.array([0]))
        assert reader.stats().batches == 0


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(KernelError, match="cannot open .*nope.bin"):
        Reader(tmp_path / "nope.bin")


def test_refused_direct_io_falls_back_with_a_warning():
    with pytest.warns(DirectIOWarning, match="refuses O_DIRECT"):
        reader = Reader("/proc/version", n_threads=1)  # procfs refuses O_DIRECT
    assert not reader.direct
    reader.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Reader("/proc/version", n_threads=1, direct=False).close()


def resident_pages(path):
    """Pages of path in the page cache, by mincore(2) on a fresh mapping of the file."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    vec = np.zeros((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE, dtype=np.uint8)  # (pages,)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            pytest.skip(f"mmap failed: {os.strerror(ctypes.get_errno())}")
        status = libc.mincore(addr, size, vec.ctypes.data)
        libc.munmap(addr, size)
    finally:
        os.close(fd)
    if status != 0:
        pytest.skip(f"mincore failed: {os.strerror(ctypes.get_errno())}")
    return int((vec & 1).sum())


def drop_from_page_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_reads_bypass_the_page_cache(tmp_path):
    path = tmp_path / "cold.bin"
    data = np.random.default_rng(1).integers(0, 256, 8 << 20, dtype=np.uint8)  # (8 MiB,)
    path.write_bytes(data.tobytes())
    python_read(path, 0, 8 << 20)
    if resident_pages(path) == 0:
        pytest.skip("this filesystem does not report cached pages through mincore")
    drop_from_page_cache(path)
    if resident_pages(path) != 0:
        pytest.skip("posix_fadvise(DONTNEED) cannot drop this file's pages here")
    dst = aligned_empty(8 << 20)  # (file bytes,)
    with Reader(path, n_threads=4) as reader:
        if not reader.direct:
            pytest.skip(f"O_DIRECT refused on {tmp_path}")
        reader.read(np.arange(64) * (128 << 10), np.full(64, 128 << 10), dst,
                    np.arange(64) * (128 << 10))
    assert np.array_equal(dst, data)
    assert resident_pages(path) == 0
