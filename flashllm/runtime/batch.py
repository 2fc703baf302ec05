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
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from flashllm.runtime.model import ROW_TILE, ContextError

__all__ = ["ROW_TILE", "pass_rows"]


def pass_rows(nets: Sequence, chunks: Sequence[Sequence[int]], positions: Sequence[int],
              prefill: bool = False) -> np.ndarray:
    """logits (B, vocab) of each stream's last row after feeding chunks[b] (T_b,) to nets[b] at
    positions[b] ..; their keys and values enter each net's KV cache. prefill: the chunks are
    prompts' (the FFN's prefill path), else answers' next tokens. One stream runs
    Model.forward, as `run` does."""
    if len(nets) == 1:
        rows = nets[0].forward(np.asarray(chunks[0], dtype=np.int32), int(positions[0]),
                               last_only=prefill)
        return rows[-1:]                                                  # (1, vocab)
    base = nets[0]
    tok = np.concatenate([np.asarray(c, dtype=np.int32) for c in chunks])  # (T,)
    pos = np.concatenate([np.arange(p, p + len(c), dtype=np.int32)
                          for c, p in zip(chunks, positions)])            # (T,)
    ends = np.cumsum([len(c) for c in chunks])                            # (B,)
    spans = [(net, int(e) - len(c), int(e)) for net, c, e in zip(nets, chunks, ends)]
    for net, c, p in zip(nets, chunks, positions):
        if not c or p < 0 or p + len(c) > net.n_ctx:
            raise ContextError(f"cannot run {len(c)} tokens at position {p}: the context "
                               f"holds {net.n_ctx}")
        net.fed[p:p + len(c)] = c
    base.ffn.start_pass(len(tok), prefill=prefill, pos0=int(pos.min()))
    x = base.embed_rows(tok, pos)                                         # (T, d_model)
    for i in range(base.config.n_layers):
        layer = base.w.layer(i)                   # a streamed layer: read once for all streams
        base.attention_rows(i, layer, x, pos, spans)                      # x (T, d_model) += attn
        base.ffn_rows(i, layer, x)                                        # x (T, d_model) += ffn
    last = ends - 1                                                       # (B,)
    return base.output_rows(np.ascontiguousarray(x[last]), pos[last], tok[last])  # (B, vocab)
