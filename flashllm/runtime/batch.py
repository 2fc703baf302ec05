"""A pass over several streams: a chunk of tokens of each (the next token of an answer, or part
of a prompt), through one forward pass.

Each stream is a Model with its own KV cache; all share one FFN strategy, one set of dense
weights and one output head. Per layer, the layer's dense weights are taken once (a streamed
layer is read once for all streams), the norm and the attention's q / k / v and output products
run on the stacked rows of every stream (ROW_TILE rows a product), the attention itself per
stream on its own KV cache, and the FFN on the stacked rows, so its flash reads (cold neurons,
the read-ahead's bundles, a streamed head) serve every stream in one go. Up to ROW_TILE (10)
rows in a pass, a row's sums do not depend on the other rows for quantized weights (their int8
tiles give every token its one-token numbers; f32 / f16 weights' 4x4 float tiles sum in another
order from 4 rows on), so a stream's greedy tokens are the same alone or batched — except where
a trained predictor chooses the FFN's neurons: a decode pass takes the union of its rows'
predictions, so a batched row may get neurons its own prediction left out (as draft guesses do
in `run`). Above ROW_TILE rows the FFN's and the head's GEMM panels sum in another order, so
the server never puts more rows in one pass (serve/worker.py).

A stream's chunk may also be its fed token with its draft's guesses and siblings (verify_rows:
every row's logits, Model.forward's siblings), so one pass verifies each stream's guesses; a
self draft's ColdCarry records its own stream's rows of the pass (resident.SpanCarry).
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import numpy as np

from flashllm.runtime.model import ROW_TILE, ContextError
from flashllm.runtime.resident import SpanCarry

__all__ = ["ROW_TILE", "pass_rows", "verify_rows"]


def pass_rows(nets: Sequence, chunks: Sequence[Sequence[int]], positions: Sequence[int],
              prefill: bool = False, carries: Sequence = ()) -> np.ndarray:
    """logits (B, vocab) of each stream's last row after feeding chunks[b] (T_b,) to nets[b] at
    positions[b] ..; their keys and values enter each net's KV cache. prefill: the chunks are
    prompts' (the FFN's prefill path), else answers' next tokens. One stream runs
    Model.forward, as `run` does. carries: each stream's ColdCarry (runtime/resident.py; None:
    none), which records its rows of the pass for its self draft."""
    if len(nets) == 1:
        with carrying(nets[0].ffn, carries, [(0, len(chunks[0]), int(positions[0]))]):
            rows = nets[0].forward(np.asarray(chunks[0], dtype=np.int32), int(positions[0]),
                                   last_only=prefill)
        return rows[-1:]                                                  # (1, vocab)
    x, pos, tok, ends = _layers(nets, chunks, [len(c) for c in chunks], positions, prefill,
                                carries)                                  # x (T, d_model)
    last = ends - 1                                                       # (B,)
    return nets[0].output_rows(np.ascontiguousarray(x[last]), pos[last], tok[last])  # (B, vocab)


def verify_rows(nets: Sequence, chunks: Sequence[Sequence[int]], positions: Sequence[int],
                siblings: Sequence[Sequence[int]], carries: Sequence = ()) -> list:
    """The logits of every row of each stream's decode pass: chunks[b] is [fed token] + its
    guesses + its siblings' tokens, the last len(siblings[b]) standing at positions[b] +
    siblings[b][s] (Model.forward's siblings). [(T_b, vocab)] per stream, as Model.forward
    gives them; the chains' keys and values enter each net's cache, the siblings' stay aside
    (Model.keep_sibling)."""
    if len(nets) == 1:
        with carrying(nets[0].ffn, carries, [(0, len(chunks[0]), int(positions[0]))]):
            return [nets[0].forward(np.asarray(chunks[0], dtype=np.int32), int(positions[0]),
                                    siblings=list(siblings[0]))]          # [(T, vocab)]
    chains = [len(c) - len(s) for c, s in zip(chunks, siblings)]
    x, pos, tok, ends = _layers(nets, chunks, chains, positions, False, carries,
                                siblings)                                 # x (T, d_model)
    rows = nets[0].output_rows(x, pos, tok)                               # (T, vocab)
    return np.split(rows, ends[:-1])                                      # [(T_b, vocab)]


def _layers(nets, chunks, chains, positions, prefill, carries, siblings=None) -> tuple:
    """Every layer over the stacked chunks: (x (T, d_model) after the last layer, pos (T,),
    tokens (T,), ends (B,): where each stream's rows end). chains[b]: the chunk's first
    tokens that continue its context (the rest: siblings at positions[b] + siblings[b])."""
    base = nets[0]
    sibs = siblings or [()] * len(nets)
    tok = np.concatenate([np.asarray(c, dtype=np.int32) for c in chunks])  # (T,)
    pos = np.concatenate([np.concatenate([np.arange(p, p + n, dtype=np.int32),
                                          p + np.asarray(s, dtype=np.int32).reshape(-1)])
                          for n, p, s in zip(chains, positions, sibs)])   # (T,)
    ends = np.cumsum([len(c) for c in chunks])                            # (B,)
    spans = [(net, int(e) - len(c), int(e), n)
             for net, c, e, n in zip(nets, chunks, ends, chains)]
    for net, c, p, n in zip(nets, chunks, positions, chains):
        if not n or p < 0 or p + n > net.n_ctx:
            raise ContextError(f"cannot run {n} tokens at position {p}: the context "
                               f"holds {net.n_ctx}")
        net.feed(np.asarray(c, dtype=np.int32), p, n)
    rows = [(a, e, int(p)) for (_, a, e, _), p in zip(spans, positions)]
    with carrying(base.ffn, carries, rows):
        base.ffn.start_pass(len(tok), prefill=prefill, pos0=int(pos.min()))
        x = base.embed_rows(tok, pos)                                     # (T, d_model)
        for i in range(base.config.n_layers):
            layer = base.w.layer(i)               # a streamed layer: read once for all streams
            base.attention_rows(i, layer, x, pos, spans)                  # x (T, d_model) += attn
            base.ffn_rows(i, layer, x)                                    # x (T, d_model) += ffn
    return x, pos, tok, ends


@contextlib.contextmanager
def carrying(ffn, carries: Sequence, rows: Sequence[tuple]):
    """During a pass, ffn (a SparseFlashFfn) records each stream's rows (a, e, pos0) for its
    ColdCarry (carries: one a stream, None where it has none; empty: no self draft)."""
    if not any(c is not None for c in carries):
        yield
        return
    old = ffn.carry
    ffn.carry = carries[0] if len(carries) == 1 else SpanCarry(list(zip(carries, rows)))
    try:
        yield
    finally:
        ffn.carry = old
