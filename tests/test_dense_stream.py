"""Streamed dense weights (embedding rows, attention per layer, the output head in row chunks,
read from dense.bin through the direct-I/O reader) give exactly the logits of resident ones, and
read exactly the bytes they stream."""
from __future__ import annotations

import numpy as np
import pytest

from flashllm.ffi import kernel
from flashllm.format.reader import open_flash
from flashllm.model.tensor import PackedTensor
from flashllm.runtime.layer import attn_names
from flashllm.runtime.weights import DenseWeights
from flashllm.ffi.reader import Reader
from flashllm.runtime.model import Model
from tiny_sources import tiny_arrays, tiny_config, write_arrays


def write_model(out, glu: bool, dtype: str, tied: bool):
    """A tiny model with a vocabulary of 150 rows: the head streams in 3 chunks of 64 rows."""
    cfg = tiny_config(glu=glu, tied_embeddings=tied, vocab_size=150)
    arrays = tiny_arrays(cfg, seed=3)
    if not tied:
        arrays["output.weight"] = np.random.default_rng(9).standard_normal(
            (cfg.vocab_size, cfg.d_model)).astype(np.float32)                      # (vocab, d)
    write_arrays(out, cfg, arrays, dtype)
    return cfg


def streamed_model(path, streamed, n_ctx=16, chunk_bytes=1):
    flash = open_flash(path)
    weights = DenseWeights(flash, 1, streamed, Reader(flash.dense_file, n_threads=2),
                           chunk_bytes=chunk_bytes)
    return Model(flash, n_threads=1, n_ctx=n_ctx, weights=weights), weights


def run(model, prompt, steps):
    """Prefill logits, then each decode step's logits (greedy): a list of (T, vocab) arrays."""
    out = [model.forward(np.array(prompt), 0)]
    for p in range(len(prompt), len(prompt) + steps):
        out.append(model.forward(np.array([int(np.argmax(out[-1][-1]))]), p))
    return out


@pytest.mark.parametrize("glu,dtype,tied", [(True, "f32", False), (True, "q8_0", True),
                                            (False, "q4_0", False), (False, "f16", True)])
def test_streamed_logits_equal_resident(tmp_path, glu, dtype, tied):
    cfg = write_model(tmp_path / "m", glu, dtype, tied)
    every = {"token_embd.weight", "output.weight"} | {n for i in range(cfg.n_layers)
                                                      for n in attn_names(i)}
    flash = open_flash(tmp_path / "m")   # resident as a budget keeps it: rows as stored, the
    # kernels a streamed matrix meets (a run without a budget packs q8_0: other sums' order)
    resident = run(Model(flash, n_threads=1, n_ctx=16, weights=DenseWeights(flash, 1)),
                   [1, 5, 9, 5], 6)
    for streamed in (every, set(attn_names(1)), {"token_embd.weight"}):
        model, _ = streamed_model(tmp_path / "m", streamed)
        got = run(model, [1, 5, 9, 5], 6)
        for a, b in zip(got, resident):
            np.testing.assert_array_equal(a, b)


def test_bytes_read_are_the_streamed_matrices(tmp_path):
    cfg = write_model(tmp_path / "m", True, "q8_0", tied=False)
    flash = open_flash(tmp_path / "m")
    nbytes = lambda n: flash.dense_entry(n)["nbytes"]
    row = nbytes("token_embd.weight") // cfg.vocab_size
    model, w = streamed_model(tmp_path / "m", {"token_embd.weight", "output.weight",
                                               *attn_names(0), *attn_names(1)})
    model.forward(np.array([3, 3, 7]), 0)
    per_pass = sum(nbytes(n) for i in range(cfg.n_layers) for n in attn_names(i)) \
        + nbytes("output.weight")
    w.close()   # wait for the prefetch of layer 0 for the next token
    assert w.bytes_read == 2 * row + per_pass + sum(nbytes(n) for n in attn_names(0))


@pytest.mark.realmodel
def test_streamed_dense_gives_the_same_tokens_smollm2():
    from conftest import _converted
    path = _converted("smollm2-135m", "q8_0", log=lambda m: None)
    cfg = open_flash(path).config
    streamed = {"token_embd.weight"} | {n for i in range(0, cfg.n_layers, 2) for n in attn_names(i)}
    prompt = [1, 504, 3458, 282, 4649, 314]
    flash = open_flash(path)   # resident rows as stored (unpacked): the streamed matrices' kernels
    want = [int(np.argmax(r[-1])) for r in run(Model(flash, 1, 64, weights=DenseWeights(flash, 1)),
                                                prompt, 8)]
    model, w = streamed_model(path, streamed, n_ctx=64, chunk_bytes=4 << 20)
    assert [int(np.argmax(r[-1])) for r in run(model, prompt, 8)] == want
    assert w.bytes_read > 0


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
def test_a_packed_tied_head_embeds_its_rows_unpacked(tmp_path, dtype):
    """A tied head packed for the matmul (no second copy of token_embd): embeddings exactly the
    unpacked rows', logits those of the rows as stored up to the packed kernel's sum order."""
    cfg = tiny_config(glu=True, tied_embeddings=True, vocab_size=160)   # 10 groups of 16 rows
    write_arrays(tmp_path / "m", cfg, tiny_arrays(cfg, seed=3), dtype)
    flash = open_flash(tmp_path / "m")
    plain, packed = DenseWeights(flash, 1), DenseWeights(flash, 2, pack=True)
    if not kernel.unpacks(dtype, cfg.vocab_size, cfg.d_model):
        pytest.skip("this build has no packed layout")
    assert isinstance(packed.head, PackedTensor) and packed.token_embd is None
    tokens = np.array([5, 159, 0, 5, 77, 16])                             # (6,)
    np.testing.assert_array_equal(packed.embed(tokens), plain.embed(tokens))
    x = np.random.default_rng(1).standard_normal((3, cfg.d_model)).astype(np.float32)
    want = plain.output(x)                                                # (3, vocab)
    np.testing.assert_allclose(packed.output(x), want, atol=1e-5 * np.abs(want).max())
