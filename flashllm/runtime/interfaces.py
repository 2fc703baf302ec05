"""What a forward pass (runtime/model.py) asks of its parts, declared: the FFN strategy, the
dense weights, and what those weights and the sparse head take from a static pass's read stream.
Each implementation subclasses its Protocol, so an optional capability is a method with a default
here, never probed for; one outside runtime/ (sparsity/calibrate.py's RecordingFfn, a lower
layer) conforms by its shape.

    FfnStrategy   DenseFfn (ffn.py), MoeFfn (moe.py), ExpertFlashFfn (expert_ffn.py),
                  SparseFlashFfn (sparse_ffn.py), ResidentFfn (resident.py)
    DenseSource   DenseWeights (weights.py), ResidentWeights (resident.py)
    ReadStream    PassStream (stream.py)
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional, Protocol

import numpy as np

from flashllm.model.tensor import QTensor
from flashllm.runtime.layer import Layer

HeadChunks = Iterator[tuple[int, np.ndarray, Optional[dict]]]  # (extent index, its bytes (n,),
                                                    # read counters; None: counted by the reader)


class FfnStrategy(Protocol):
    """How a layer's feed-forward network is computed (runtime/ffn.py tells the seam)."""

    def start_pass(self, n_tokens: int, prefill: bool, pos0: int = 0) -> None:
        """A forward pass over n_tokens at positions pos0 .. begins (prefill: a prompt's)."""
        ...

    def __call__(self, layer: int, h: np.ndarray, x: np.ndarray) -> None:
        """x (T, d_model) += layer's FFN of h (T, d_model), the normalized FFN input."""
        ...

    def stats(self) -> dict:
        """The --stats counters (runtime/stats.py); {} when it reads nothing."""
        ...

    def forget_records(self) -> None:
        """Drop the per-pass records kept for --stats (a server's passes never end: they
        would grow without bound); by default it keeps none."""

    def close(self) -> None:
        """Stop its threads and close its readers; by default it holds none."""


class DenseSource(Protocol):
    """The dense weights of a forward pass: embeddings, each layer's attention and norms, the
    output head."""

    pos_embd: Optional[QTensor]         # (n_pos, d_model): learned positions (OPT)
    proj_in: Optional[QTensor]          # (d_model, embed_dim)
    proj_out: Optional[QTensor]         # (embed_dim, d_model)
    out_norm: np.ndarray                # (d_model,)
    out_norm_b: Optional[np.ndarray]    # (d_model,)

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """(T, embed_dim) f32 embedding rows of tokens (T,)."""
        ...

    def layer(self, i: int) -> Layer:
        """Layer i's weights (streamed matrices valid until the next call)."""
        ...

    def resident_layer(self, i: int) -> Optional[Layer]:
        """Layer i when its matrices stay in DRAM, else None; nothing is read."""
        ...

    def output(self, x: np.ndarray, exact: bool = False) -> np.ndarray:
        """(T, vocab) f32 logits of the normalized final hidden states x (T, embed_dim)."""
        ...

    def see(self, tokens: Iterable[int]) -> None:
        """Tokens the context has used (a draft's head holds their rows); by default nothing."""


class ReadStream(Protocol):
    """The dense part of a static pass's read stream, as the dense weights and the sparse head
    take it: pieces read ahead in the order a pass uses them."""

    def attention(self, layer: int) -> Optional[tuple[np.ndarray, dict]]:
        """(layer's streamed attention bytes, read counters), valid until the next take; None
        when the stream does not carry that layer."""
        ...

    def head_chunks(self, name: str) -> Optional[HeadChunks]:
        """The extents of the dense matrix `name` (the head, or its sketch) as the stream reads
        them; None when it carries no such matrix."""
        ...
