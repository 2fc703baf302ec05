"""The output head's sketch: a 2.6-bit copy of the head that ranks the vocabulary in DRAM, so a run
whose head streams reads only the candidate rows (runtime/sparse_head.py, docs/PREDICTOR.md).

Each head row is padded with zeros to whole superblocks of 256 and stored as ggml's Q2_K (16-value
sub-blocks of 2-bit values, a 4-bit scale and min each against an f16 scale and min per 256) —
quantized here by the sub-block's range (the min clamped to <= 0), not by ggml's slower search —
with the mean squared error of each superblock, what the runtime's per-logit error bound needs:
for a hidden state x, |sketch . x - head . x| has the standard deviation
sqrt(sum_b |x_b|^2 * var_b) if the rounding errors are independent of x.
"""
from __future__ import annotations

import numpy as np

from flashllm.format.layout import SKETCH, SKETCH_VAR
from flashllm.model.tensor import QTensor

QK_K = 256
CHUNK_VALUES = 1 << 19               # values quantized at a time (bounds the f32 temporaries)


def padded(d: int) -> int:
    """The sketch's row length: d rounded up to whole superblocks."""
    return -(-d // QK_K) * QK_K


def q2k_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w (n, d) f32 with d % 256 == 0 -> (Q2_K bytes (n, d / 256 * 84) uint8, the mean squared
    error of each superblock (n, d / 256) f32), the error measured on the values as gguf-py's
    dequantization gives them back."""
    n, d = w.shape
    nb = d // QK_K
    g = w.reshape(n, nb, 16, 16)                                          # (n, nb, 16, 16)
    lo = np.minimum(g.min(axis=-1), 0)                                    # (n, nb, 16)
    sc = (g.max(axis=-1) - lo) / 3                                        # (n, nb, 16)
    d16 = (sc.max(axis=-1) / 15).astype(np.float16)                       # (n, nb)
    m16 = ((-lo).max(axis=-1) / 15).astype(np.float16)                    # (n, nb)
    df, mf = d16.astype(np.float32)[..., None], m16.astype(np.float32)[..., None]  # (n, nb, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.where(df > 0, np.clip(np.rint(sc / df), sc > 0, 15), 0).astype(np.uint8)
        lm = np.where(mf > 0, np.clip(np.rint(-lo / mf), 0, 15), 0).astype(np.uint8)
        dl = df * ls.astype(np.float32)                                   # (n, nb, 16)
        ml = mf * lm.astype(np.float32)                                   # (n, nb, 16)
        q = np.where(dl[..., None] > 0,
                     np.clip(np.rint((g + ml[..., None]) / dl[..., None]), 0, 3), 0)
    q = q.astype(np.uint8)                                                # (n, nb, 16, 16)
    back = dl[..., None] * q.astype(np.float32) - ml[..., None]           # (n, nb, 16, 16)
    var = ((back - g) ** 2).reshape(n, nb, QK_K).mean(axis=-1, dtype=np.float64)  # (n, nb)
    v = q.reshape(n, nb, 2, 4, 32)                                        # (n, nb, half, shift, l)
    qs = v[:, :, :, 0] | (v[:, :, :, 1] << 2) | (v[:, :, :, 2] << 4) | (v[:, :, :, 3] << 6)
    blk = np.concatenate([ls | (lm << 4), qs.reshape(n, nb, 64),
                          d16.view(np.uint8).reshape(n, nb, 2),
                          m16.view(np.uint8).reshape(n, nb, 2)], axis=-1)  # (n, nb, 84)
    return np.ascontiguousarray(blk.reshape(n, nb * 84)), var.astype(np.float32)


def sketch_blocks(head_rows, vocab: int, d: int, var: np.ndarray):
    """The Q2_K rows of a head (vocab, d) given by head_rows(r0, r1) -> f32 (r1 - r0, d), as
    consecutive (rows, d_pad / 256 * 84) uint8 blocks of CHUNK_VALUES values; the error of
    each superblock goes into var (vocab, d_pad / 256) f32 as they are made."""
    dp = padded(d)
    step = max(1, CHUNK_VALUES // dp)
    for r0 in range(0, vocab, step):
        r1 = min(vocab, r0 + step)
        w = np.zeros((r1 - r0, dp), np.float32)                          # (rows, d_pad)
        w[:, :d] = head_rows(r0, r1)
        data, var[r0:r1] = q2k_rows(w)
        yield data


def write(w, head_rows, vocab: int, d: int) -> None:
    """Add the sketch tensors (layout.SKETCH_NAMES) of a head (vocab, d) given by head_rows to
    the FlashWriter w, one CHUNK_VALUES block in memory at a time (and the error, vocab * d / 64
    bytes)."""
    dp = padded(d)
    var = np.empty((vocab, dp // QK_K), np.float32)                      # (vocab, nb)
    w.add_tensor_rows(SKETCH, (vocab, dp), sketch_blocks(head_rows, vocab, d, var), "q2_k")
    w.add_tensor(SKETCH_VAR, QTensor(var.view(np.uint8).reshape(vocab, -1), "f32", vocab,
                                     dp // QK_K))


def build(head: np.ndarray) -> tuple[QTensor, QTensor]:
    """The sketch tensors of head (vocab, d) f32: (Q2_K (vocab, d_pad), its error f32
    (vocab, d_pad / 256)), quantized CHUNK_VALUES values at a time."""
    vocab, d = head.shape
    dp = padded(d)
    var = np.empty((vocab, dp // QK_K), np.float32)                      # (vocab, nb)
    data = np.concatenate(list(sketch_blocks(lambda r0, r1: head[r0:r1], vocab, d, var)))
    return (QTensor(data, "q2_k", vocab, dp),                            # (vocab, row bytes)
            QTensor(var.view(np.uint8).reshape(vocab, -1), "f32", vocab, dp // QK_K))
