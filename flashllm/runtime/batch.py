"""A decode pass over several streams: the next token of each, through one forward pass.

Each stream is a Model with its own KV cache; all share one FFN strategy, one set of dense
weights and one output head. Per layer, the layer's dense weights are taken once (a streamed
layer is read once for all streams), attention runs per stream on its own KV cache, and the FFN
runs on the stacked rows of every stream, so its flash reads (cold neurons, the read-ahead's
bundles, a streamed head) serve every stream in one go. A row's sums do not depend on the other
rows (the kernels keep a token's sums independent of the pass's size), so a stream's greedy
tokens are the same alone or batched — except where a trained predictor chooses the FFN's
neurons: a decode pass takes the union of its rows' predictions, so a batched row may get
neurons its own prediction left out (as draft guesses do in `run`).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from flashllm.runtime.model import ContextError


def decode_rows(nets: Sequence, tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """logits (B, vocab) of feeding tokens[b] (B,) to nets[b] at positions[b] (B,); their keys
    and values enter each net's KV cache. One stream runs Model.forward (`run`'s decode path)."""
    if len(nets) == 1:
        return nets[0].forward(np.array(tokens[:1], dtype=np.int32), int(positions[0]))
    base = nets[0]
    tok = np.asarray(tokens, dtype=np.int32)                              # (B,)
    pos = np.asarray(positions, dtype=np.int32)                           # (B,)
    for net, t, p in zip(nets, tok, pos):
        if not 0 <= p < net.n_ctx:
            raise ContextError(f"cannot run a token at position {p}: the context holds "
                               f"{net.n_ctx}")
        net.fed[p] = t
    base.ffn.start_pass(len(tok), prefill=False, pos0=int(pos.min()))
    x = base.embed_rows(tok, pos)                                         # (B, d_model)
    for i in range(base.config.n_layers):
        layer = base.w.layer(i)                   # a streamed layer: read once for all streams
        for b, net in enumerate(nets):
            net.attention_rows(i, layer, x[b:b + 1], pos[b:b + 1])        # x[b] += attention
        base.ffn_rows(i, layer, x)                                        # x (B, d_model) += ffn
    return base.output_rows(x, pos, tok)                                  # (B, vocab)
