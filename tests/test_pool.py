"""The kernel's worker threads (native/pool.c): a section gives the same numbers on any number of
threads, sections asked for from several Python threads at once all finish with the right
result, and a forked child (which inherits none of the parent's threads) still computes."""
import multiprocessing
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from flashllm.ffi import kernel
from flashllm.ffi.quant import quantize_rows
from flashllm.model.tensor import QTensor


def _weight(rows: int, cols: int, seed: int) -> QTensor:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)  # (rows, cols)
    return QTensor(quantize_rows(w, "q4_0"), "q4_0", rows, cols)


def _bundles(n: int, d: int, seed: int) -> np.ndarray:
    """(n, stride) q4_0 bundles [gate | up | down] of random values."""
    w = np.random.default_rng(seed).standard_normal((3 * n, d)).astype(np.float32)  # (3n, d)
    rows = quantize_rows(w, "q4_0")                                            # (3n, row_bytes)
    return np.ascontiguousarray(rows.reshape(n, -1))                            # (n, 3 * row_bytes)


@pytest.mark.parametrize("T", [1, 3, 40])
def test_sections_give_the_same_numbers_on_any_thread_count(T):
    w = _weight(300, 256, 0)
    x = np.random.default_rng(1).standard_normal((T, 256)).astype(np.float32)  # (T, 256)
    one = kernel.matmul(w, x, None, 1)                                          # (T, 300)
    for threads in (2, 3, 7):     # more threads than this machine has cores
        np.testing.assert_array_equal(kernel.matmul(w, x, None, threads), one)
    b = _bundles(512, 256, 2)
    y1 = np.zeros((T, 256), np.float32)                                          # (T, 256)
    kernel.ffn_bundles(b, "q4_0", 256, True, "silu", x, y1, n_threads=1)
    for threads in (2, 5):
        y = np.zeros((T, 256), np.float32)                                      # (T, 256)
        kernel.ffn_bundles(b, "q4_0", 256, True, "silu", x, y, n_threads=threads)
        np.testing.assert_array_equal(y, y1)


@pytest.mark.parametrize("T", [1, 3, 12, 40])
@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_a_layer_cut_at_blocks_sums_as_one_call(T, threshold):
    """Calls over a layer's rows cut at multiples of ffn_block() (a neuron cache's rows, then the
    read-ahead's chunks) give y the bits of one call over them all, on any number of threads:
    the text of a run then does not depend on the size of its caches."""
    block, n = kernel.ffn_block(), 700
    b = _bundles(n, 256, 3)                                                      # (n, stride)
    x = np.random.default_rng(4).standard_normal((T, 256)).astype(np.float32)   # (T, 256)
    y0 = np.random.default_rng(5).standard_normal((T, 256)).astype(np.float32)  # the residual
    one = y0.copy()
    kernel.ffn_bundles(b, "q4_0", 256, True, "silu", x, one, n_threads=2, threshold=threshold)
    for cuts, threads in (([block], 1), ([3 * block, 5 * block], 2), ([block, 2 * block], 3)):
        y = y0.copy()
        for lo, hi in zip([0, *cuts], [*cuts, n]):
            kernel.ffn_bundles(np.ascontiguousarray(b[lo:hi]), "q4_0", 256, True, "silu", x, y,
                               n_threads=threads, threshold=threshold)
        np.testing.assert_array_equal(y, one)
        rows = np.arange(n, dtype=np.int32)           # the same through rows (a cache's matrix)
        y = y0.copy()
        for lo, hi in zip([0, *cuts], [*cuts, n]):
            kernel.ffn_bundles(b, "q4_0", 256, True, "silu", x, y, n_threads=threads,
                               rows=rows[lo:hi], threshold=threshold)
        np.testing.assert_array_equal(y, one)


def test_sections_from_many_python_threads_at_once():
    """One team: a section asked for while another runs runs on its caller's thread alone."""
    ws = [_weight(512, 512, s) for s in range(8)]
    xs = [np.random.default_rng(10 + s).standard_normal((2, 512)).astype(np.float32)
          for s in range(8)]                                                    # each (2, 512)
    want = [kernel.matmul(w, x, None, 1) for w, x in zip(ws, xs)]              # each (2, 512)

    def job(i: int) -> bool:
        return all(np.array_equal(kernel.matmul(ws[i], xs[i], None, 2), want[i])
                   for _ in range(50))

    with ThreadPoolExecutor(4) as ex:
        assert all(ex.map(job, range(8)))


def _child(conn) -> None:
    w = _weight(64, 128, 3)
    x = np.ones((1, 128), np.float32)                                           # (1, 128)
    conn.send(kernel.matmul(w, x, None, 2).tolist())
    conn.close()


def test_a_forked_child_computes():
    w = _weight(64, 128, 3)
    x = np.ones((1, 128), np.float32)                                           # (1, 128)
    want = kernel.matmul(w, x, None, 2)    # the parent's team is running before the fork
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child,))
    proc.start()
    assert parent.poll(60), "the forked child did not answer within 60 s"
    got = np.array(parent.recv(), np.float32)
    proc.join(10)
    assert proc.exitcode == 0
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("sanitizer", ["thread", "address,undefined"])
def test_the_team_under_a_sanitizer(tmp_path, sanitizer):
    """tests/native/pool_driver.c (also `make test-asan`): races, leaks and undefined behaviour
    of native/pool.c under back-to-back sections, sleeping workers and concurrent callers."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    root = Path(__file__).resolve().parents[1]
    exe = tmp_path / "pool_driver"
    build = subprocess.run([cc, "-g", "-O1", f"-fsanitize={sanitizer}", "-std=c11", "-Wall",
                            "-Wextra", "-Werror", "-D_GNU_SOURCE", f"-I{root / 'native'}",
                            str(root / "tests/native/pool_driver.c"), str(root / "native/pool.c"),
                            "-o", str(exe), "-lpthread"], capture_output=True, text=True)
    if build.returncode != 0 and "sanitize" in build.stderr:
        pytest.skip(f"this compiler has no -fsanitize={sanitizer}: {build.stderr.strip()[:200]}")
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300,
                         env={"TSAN_OPTIONS": "halt_on_error=1", "ASAN_OPTIONS": "detect_leaks=1"})
    assert run.returncode == 0, run.stdout + run.stderr
