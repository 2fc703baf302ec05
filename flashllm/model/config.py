"""Model hyperparameters: one frozen dataclass, read from HF config.json or GGUF metadata by the
sources, stored in the flash manifest, and read back by the runtime."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flashllm.errors import FormatError

NORMS = ("rms", "layer")
ACTS = ("silu", "gelu", "relu", "gelu_tanh")
POSITIONS = ("rope", "learned")
_TUPLES = ("eos_token_ids", "rope_freq_factors", "sliding_layers")   # JSON lists in the manifest


@dataclass(frozen=True)
class ModelConfig:
    arch: str                   # an architecture registered in model/archs/ (arch_named)
    vocab_size: int
    d_model: int                # hidden size
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_ff: int                   # FFN neurons per layer
    context_length: int
    norm: str                   # "rms" | "layer"
    norm_eps: float
    act: str                    # "silu" | "gelu" (erf) | "relu" | "gelu_tanh" (tanh approximation)
    glu: bool                   # gated FFN (gate, up, down) vs plain (up, down)
    pos: str                    # "rope" | "learned"
    rope_theta: float = 10000.0
    pos_offset: int = 0         # OPT's learned positions start at index 2
    d_embed: int = 0            # OPT word_embed_proj_dim; 0 means d_model
    tied_embeddings: bool = False
    attn_qkv_bias: bool = False
    attn_out_bias: bool = False
    ffn_bias: bool = False      # bias on up and down (OPT fc1/fc2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Fields below came later; their defaults are what folders converted before them mean.
    qk_norm: bool = False       # RMSNorm over each head's q and k before RoPE (attn_q_norm, attn_k_norm)
    rope_freq_factors: tuple[float, ...] = ()   # (head_dim / 2) divisors of the RoPE frequencies
                                                # (rope scaling, model/rope.py); () for none
    sliding_window: int = 0     # keys a sliding layer's query sees, its own included; 0: none
    sliding_layers: tuple[int, ...] = ()   # the layers attending through that window
    qk_norm_full: bool = False  # QK-norm over the whole q / k projection, not per head (OLMoE)
    n_experts: int = 0          # mixture of experts: routed experts per layer; 0 = a dense FFN
    n_experts_used: int = 0     # experts a token is routed to (the router's top-k)
    norm_topk: bool = False     # the top-k router weights renormalised to sum to 1
    n_ff_shared: int = 0        # neurons of the always-on shared expert (Qwen2-MoE), 0: none
    rope_local_theta: float = 0.0   # RoPE base of the sliding layers, without rope_freq_factors
                                    # (Gemma 3's local layers); 0: as every other layer
    sandwich_norm: bool = False # RMSNorm of the attention and FFN outputs before the residual
                                # add (post_attention_norm, post_ffw_norm: Gemma 2/3)
    embed_scale: float = 1.0    # token embeddings times this (Gemma: sqrt(d_model))
    attn_scale: float = 0.0     # attention scores times this; 0: head_dim^-0.5
    final_softcap: float = 0.0  # logits = cap * tanh(logits / cap); 0: none
    residual_scale: float = 1.0 # attention and FFN outputs times this before the residual add
                                # (Granite's residual_multiplier)
    logit_scale: float = 1.0    # logits divided by this (Granite's logits_scaling)

    @property
    def embed_dim(self) -> int:
        return self.d_embed or self.d_model

    @property
    def max_positions(self) -> int | None:
        """The most positions a pass may reach: context_length for learned position embeddings
        (a table of that many rows, OPT), None for RoPE (any; past training, quality drops)."""
        return self.context_length if self.pos == "learned" else None

    @property
    def ffn_slots(self) -> int:
        """Bundle slots per layer in the FFN file: n_ff, or for a mixture of experts every
        expert's n_ff neurons (expert e at slots e·n_ff ..) and then the shared expert's."""
        return self.n_experts * self.n_ff + self.n_ff_shared if self.n_experts else self.n_ff

    def validate(self) -> "ModelConfig":
        """Raise FormatError naming the first field that makes no sense (that `arch` is
        registered is model/archs' arch_named, which the manifest's reader asks)."""
        if not isinstance(self.arch, str) or not self.arch:
            raise FormatError(f"config field arch={self.arch!r} must be a name")
        for name, allowed in (("norm", NORMS), ("act", ACTS), ("pos", POSITIONS)):
            if getattr(self, name) not in allowed:
                raise FormatError(f"config field {name}={getattr(self, name)!r} is not one of {allowed}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "n_ff", "context_length"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise FormatError(f"config field {name}={getattr(self, name)!r} must be a positive integer")
        f = self.rope_freq_factors
        if f and (len(f) != self.head_dim // 2 or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf") for v in f)):
            raise FormatError(f"rope_freq_factors must be {self.head_dim // 2} positive numbers, "
                              f"got {len(f)}")
        w = self.sliding_window
        if isinstance(w, bool) or not isinstance(w, int) or w < 0 or bool(w) != bool(self.sliding_layers) \
                or not all(isinstance(i, int) and 0 <= i < self.n_layers for i in self.sliding_layers):
            raise FormatError(f"sliding_window={w!r} needs sliding layers in [0, {self.n_layers}) "
                              f"(and they a window > 0), got {list(self.sliding_layers)[:4]}")
        self._validate_experts()
        for name in ("residual_scale", "logit_scale"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise FormatError(f"config field {name}={v!r} must be a finite number > 0")
        for name in ("rope_local_theta", "attn_scale", "final_softcap"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise FormatError(f"config field {name}={v!r} must be a finite number >= 0")
        if self.n_heads % self.n_kv_heads:
            raise FormatError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        return self

    def _validate_experts(self) -> None:
        for name in ("n_experts", "n_experts_used", "n_ff_shared"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise FormatError(f"config field {name}={v!r} must be a non-negative integer")
        if self.n_experts and not 1 <= self.n_experts_used <= self.n_experts:
            raise FormatError(f"n_experts_used={self.n_experts_used} must be in [1, "
                              f"n_experts={self.n_experts}]")
        if self.n_experts and not self.glu:
            raise FormatError("a mixture of experts needs gated (GLU) experts")
        if not self.n_experts and (self.n_experts_used or self.n_ff_shared):
            raise FormatError("n_experts_used / n_ff_shared without n_experts")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return {**d, **{name: list(d[name]) for name in _TUPLES}}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Inverse of to_dict, for the manifest; unknown or missing fields are a FormatError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise FormatError(f"unknown config fields in manifest: {sorted(unknown)}")
        try:
            cfg = cls(**{**d, **{name: tuple(d[name]) for name in _TUPLES if name in d}})
        except TypeError as e:
            raise FormatError(f"bad config in manifest: {e}") from None
        return cfg.validate()
