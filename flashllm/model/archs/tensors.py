"""The canonical tensors: every tensor a converted model can hold, with its shape rule, when a
model of a given config holds it, and the runtime field it fills. One table, read by the
converter (expected_tensors, check_tensor_set, the split of fused tensors), the flash layout
(required_tensors: the dense tensors and their shapes) and the runtime (runtime/layer.py,
runtime/weights.py, runtime/moe.py take names and optional-ness from here).

Names are llama.cpp's (GGUF files carry them as they are); an architecture's table
(model/archs/*.py) maps its Hugging Face tensor names onto them. A layer's tensors are named
`blk.{i}.NAME`. What a model holds follows from its ModelConfig alone, so a GGUF file (whose
names need no table) and an HF folder of one config are checked against one list.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from flashllm.errors import SourceError
from flashllm.model.config import ModelConfig

Shape = Callable[[ModelConfig], tuple]


def _always(cfg: ModelConfig) -> bool:
    return True


@dataclass(frozen=True)
class Tensor:
    name: str                                  # canonical name (a layer's, without "blk.{i}.")
    shape: Shape                               # its shape in a model of this config
    when: Callable[[ModelConfig], bool] = _always   # whether such a model holds it
    field: str | None = None                   # the runtime field it fills (Layer, DenseWeights)
    layer: bool = True                         # one per layer (blk.{i}.name), else one per model
    ffn: bool = False                          # stored as ffn.bin bundles, not in dense.bin

    def at(self, i: int | None = None) -> str:
        """Its name in layer i (or the model's own name)."""
        return f"blk.{i}.{self.name}" if self.layer else self.name


def _q(c: ModelConfig) -> int:
    return c.n_heads * c.head_dim


def _kv(c: ModelConfig) -> int:
    return c.n_kv_heads * c.head_dim


def _layer_norm(c: ModelConfig) -> bool:
    return c.norm == "layer"


def _dense_ffn(c: ModelConfig) -> bool:
    return not c.n_experts


def _shared(c: ModelConfig) -> bool:
    return bool(c.n_experts and c.n_ff_shared)


MODEL = (
    Tensor("token_embd.weight", lambda c: (c.vocab_size, c.embed_dim), layer=False),
    Tensor("output_norm.weight", lambda c: (c.d_model,), field="out_norm", layer=False),
    Tensor("output_norm.bias", lambda c: (c.d_model,), _layer_norm, "out_norm_b", layer=False),
    Tensor("output.weight", lambda c: (c.vocab_size, c.embed_dim), lambda c: not c.tied_embeddings,
           layer=False),
    Tensor("position_embd.weight", lambda c: (c.context_length + c.pos_offset, c.d_model),
           lambda c: c.pos == "learned", "pos_embd", layer=False),
    Tensor("proj_in.weight", lambda c: (c.d_model, c.embed_dim), lambda c: c.embed_dim != c.d_model,
           "proj_in", layer=False),
    Tensor("proj_out.weight", lambda c: (c.embed_dim, c.d_model), lambda c: c.embed_dim != c.d_model,
           "proj_out", layer=False),
)

LAYER = (
    # the dense tensors (dense.bin), in the order required_tensors has always listed them
    Tensor("attn_norm.weight", lambda c: (c.d_model,), field="attn_norm"),
    Tensor("ffn_norm.weight", lambda c: (c.d_model,), field="ffn_norm"),
    Tensor("attn_q.weight", lambda c: (_q(c), c.d_model), field="wq"),
    Tensor("attn_k.weight", lambda c: (_kv(c), c.d_model), field="wk"),
    Tensor("attn_v.weight", lambda c: (_kv(c), c.d_model), field="wv"),
    Tensor("attn_output.weight", lambda c: (c.d_model, _q(c)), field="wo"),
    Tensor("attn_norm.bias", lambda c: (c.d_model,), _layer_norm, "attn_norm_b"),
    Tensor("ffn_norm.bias", lambda c: (c.d_model,), _layer_norm, "ffn_norm_b"),
    Tensor("attn_q.bias", lambda c: (_q(c),), lambda c: c.attn_qkv_bias, "bq"),
    Tensor("attn_k.bias", lambda c: (_kv(c),), lambda c: c.attn_qkv_bias, "bk"),
    Tensor("attn_v.bias", lambda c: (_kv(c),), lambda c: c.attn_qkv_bias, "bv"),
    Tensor("attn_output.bias", lambda c: (c.d_model,), lambda c: c.attn_out_bias, "bo"),
    # QK-norm: per head (hd,), or over the whole projection (OLMoE: qk_norm_full)
    Tensor("attn_q_norm.weight", lambda c: (_q(c) if c.qk_norm_full else c.head_dim,),
           lambda c: c.qk_norm, "q_norm"),
    Tensor("attn_k_norm.weight", lambda c: (_kv(c) if c.qk_norm_full else c.head_dim,),
           lambda c: c.qk_norm, "k_norm"),
    Tensor("post_attention_norm.weight", lambda c: (c.d_model,), lambda c: c.sandwich_norm,
           "post_attn_norm"),
    Tensor("post_ffw_norm.weight", lambda c: (c.d_model,), lambda c: c.sandwich_norm, "post_ffn_norm"),
    # a dense FFN's biases (OPT's fc1 / fc2); an MoE router (f32) and shared-expert gate
    Tensor("ffn_up.bias", lambda c: (c.n_ff,), lambda c: c.ffn_bias and _dense_ffn(c), "up_b"),
    Tensor("ffn_down.bias", lambda c: (c.d_model,), lambda c: c.ffn_bias and _dense_ffn(c), "down_b"),
    Tensor("ffn_gate_inp.weight", lambda c: (c.n_experts, c.d_model), lambda c: bool(c.n_experts)),
    Tensor("ffn_gate_inp_shexp.weight", lambda c: (c.d_model,), _shared),
    # the FFN matrices (ffn.bin bundles): a dense FFN's gate (GLU), up, down; or the
    # routed experts and the shared expert of a mixture of experts
    Tensor("ffn_gate.weight", lambda c: (c.n_ff, c.d_model), lambda c: c.glu and _dense_ffn(c),
           ffn=True),
    Tensor("ffn_up.weight", lambda c: (c.n_ff, c.d_model), _dense_ffn, ffn=True),
    Tensor("ffn_down.weight", lambda c: (c.d_model, c.n_ff), _dense_ffn, ffn=True),
    Tensor("ffn_gate_exps.weight", lambda c: (c.n_experts, c.n_ff, c.d_model),
           lambda c: bool(c.n_experts), ffn=True),
    Tensor("ffn_up_exps.weight", lambda c: (c.n_experts, c.n_ff, c.d_model),
           lambda c: bool(c.n_experts), ffn=True),
    Tensor("ffn_down_exps.weight", lambda c: (c.n_experts, c.d_model, c.n_ff),
           lambda c: bool(c.n_experts), ffn=True),
    Tensor("ffn_gate_shexp.weight", lambda c: (c.n_ff_shared, c.d_model), _shared, ffn=True),
    Tensor("ffn_up_shexp.weight", lambda c: (c.n_ff_shared, c.d_model), _shared, ffn=True),
    Tensor("ffn_down_shexp.weight", lambda c: (c.d_model, c.n_ff_shared), _shared, ffn=True),
)

CANONICAL = {t.name: t for t in MODEL + LAYER}
BY_FIELD = {t.field: t for t in MODEL + LAYER if t.field}
ATTN_MATRICES = tuple(BY_FIELD[f] for f in ("wq", "wk", "wv", "wo"))
ROUTER = "ffn_gate_inp.weight"          # an MoE router: kept f32, as llama.cpp never quantizes it
SHARED_GATE = "ffn_gate_inp_shexp.weight"   # the shared expert's gate (d_model,); HF: (1, d_model)


def held(cfg: ModelConfig) -> list[tuple[str, Tensor]]:
    """(name, Tensor) of every tensor a model of cfg holds, the model's first, then by layer, in
    the tables' order."""
    out = [(t.at(), t) for t in MODEL if t.when(cfg)]
    layer = [t for t in LAYER if t.when(cfg)]
    return out + [(t.at(i), t) for i in range(cfg.n_layers) for t in layer]


def expected_tensors(cfg: ModelConfig) -> list[str]:
    """Every canonical tensor a checkpoint of this config must hold, in a stable order."""
    return [name for name, _ in held(cfg)]


def required_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every dense tensor (dense.bin) a model of this config needs, with its shape."""
    return {name: tuple(t.shape(cfg)) for name, t in held(cfg) if not t.ffn}


def part_rows(cfg: ModelConfig, part: str) -> int:
    """Rows of the projection `part` (attn_q, ffn_up, ...) that a fused tensor can hold."""
    return CANONICAL[part + ".weight"].shape(cfg)[0]


def check_tensor_set(cfg: ModelConfig, present: Iterable[str], where: str) -> None:
    """SourceError naming the first tensor that is missing or that the config does not expect."""
    have = set(present)
    if cfg.n_layers > len(have):       # checked first: a hostile layer count must not loop for ages
        raise SourceError(f"{where}: the config has {cfg.n_layers} layers, the checkpoint only "
                          f"{len(have)} tensors")
    expected = expected_tensors(cfg)
    missing = [n for n in expected if n not in have]
    if missing:
        raise SourceError(f"{where}: missing tensor {missing[0]!r}"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(have - set(expected))
    if extra:
        raise SourceError(f"{where}: tensor {extra[0]!r} is not expected by the {cfg.arch} config")
