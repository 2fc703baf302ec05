"""Architectures as data.

Per architecture: a table from Hugging Face tensor-name patterns to canonical names
(docs/ARCHITECTURE.md), the HF buffers that may be ignored, and the function that builds a
ModelConfig from config.json. Registered by HF class name (`ARCHITECTURES`) and, for GGUF, by
`general.architecture` (`GGUF_ARCHITECTURES`). A tensor that no table maps is a SourceError.

Patterns use `{i}` for a layer number, `{wb}` for "weight" or "bias", `{m}` for an optional
leading "model." (some OPT checkpoints omit it) and `{e}` for an expert's number: the experts of
a layer become one canonical (n_experts, ...) tensor (flashllm/model/arch_moe.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from flashllm.model.arch_moe import MIXTRAL_FFN_TABLE, QWEN_MOE_FFN_TABLE, hf_moe_fields, moe_parts
from flashllm.model.config import ModelConfig
from flashllm.model.gemma3 import gemma3_gguf_fields, gemma3_hf_config
from flashllm.model.hf_config import eos_ids, need, rope_model
from flashllm.errors import SourceError

_PLACEHOLDERS = {"{i}": r"(?P<i>\d+)", "{wb}": r"(?P<wb>weight|bias)", "{m}": r"(?:model\.)?",
                 "{e}": r"(?P<e>\d+)"}


def _compile(pattern: str) -> re.Pattern:
    rx = re.escape(pattern)
    for key, group in _PLACEHOLDERS.items():
        rx = rx.replace(re.escape(key), group)
    return re.compile(rx + r"\Z")


@dataclass(frozen=True)
class Arch:
    name: str                                   # ModelConfig.arch
    hf_class: str                               # e.g. "LlamaForCausalLM"
    gguf_arch: str | None                       # general.architecture, when GGUF files are supported
    table: tuple[tuple[str, str], ...]          # (HF pattern, canonical template)
    ignore: tuple[str, ...]                     # HF buffers that carry no weights (rotary inv_freq)
    hf_config: Callable[[Mapping], ModelConfig]
    gguf_permuted_qk: bool = False              # llama.cpp permuted attn_q/attn_k for interleaved RoPE
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()   # (tensor, the parts its rows hold)
    gguf_swa_pattern: int | None = None         # llama.cpp's sliding-window layer pattern (None: no
                                                # window; 0: every layer; n: all but every n-th)
    gguf_norm_topk: bool = False                # llama.cpp renormalises the top-k router weights
    gguf_qk_norm_full: bool = False             # its attn_q_norm spans the whole q (OLMoE)
    norm_shift: float = 0.0                     # HF norms scale by (shift + w): folded into w (f32)
    gguf_fields: Callable[[Mapping, ModelConfig], dict] | None = None   # ModelConfig fields of a
                                                # GGUF that llama.cpp fixes per architecture
    _compiled: tuple = field(default=(), compare=False, repr=False)

    def split(self, cfg: ModelConfig, name: str, rows: int) -> list[tuple[str, int, int]]:
        """[(canonical name, first row, end row)]: the parts of a fused tensor (Phi-3's attn_qkv,
        its 2·n_ff-row ffn_up), or [(name, 0, rows)] for any other tensor."""
        m = re.fullmatch(r"(blk\.\d+\.)(\w+)(\.weight)", name)
        parts = dict(self.fused).get(m.group(2), ()) if m else ()
        sizes = [part_rows(cfg, p) for p in parts]
        if not parts or sum(sizes) != rows:
            return [(name, 0, rows)]
        ends = [sum(sizes[:k + 1]) for k in range(len(sizes))]
        return [(m.group(1) + p + m.group(3), end - n, end) for p, n, end in zip(parts, sizes, ends)]

    def canonical(self, hf_name: str) -> str | None:
        """The canonical name of an HF tensor; None for an ignored buffer; SourceError if unmapped."""
        found = self.locate(hf_name)
        return None if found is None else found[0]

    def locate(self, hf_name: str) -> tuple[str, int | None] | None:
        """(canonical name, expert number or None) of an HF tensor; None for an ignored buffer;
        SourceError if unmapped."""
        for rx, template in self._compiled:
            m = rx.match(hf_name)
            if m:
                e = m.groupdict().get("e")
                return template.format(**m.groupdict()), None if e is None else int(e)
        if any(_compile(p).match(hf_name) for p in self.ignore):
            return None
        raise SourceError(f"tensor {hf_name!r} is not mapped by the {self.hf_class} table "
                          f"(flashllm/model/arch.py); refusing to skip it silently")


ARCHITECTURES: dict[str, Arch] = {}
GGUF_ARCHITECTURES: dict[str, Arch] = {}


def part_rows(cfg: ModelConfig, part: str) -> int:
    """Rows of a projection that a fused tensor can hold."""
    kv = cfg.n_kv_heads * cfg.head_dim
    return {"attn_q": cfg.n_heads * cfg.head_dim, "attn_k": kv, "attn_v": kv, "ffn_gate": cfg.n_ff,
            "ffn_up": cfg.n_ff}[part]


def register(hf_class: str, name: str, table: Iterable[tuple[str, str]], ignore: Iterable[str] = (),
             gguf_arch: str | None = None, **data):
    """Decorator: register `fn(config_json) -> ModelConfig` with its tensor table; `data` sets the
    other Arch fields (gguf_permuted_qk, fused, gguf_swa_pattern, gguf_norm_topk, norm_shift,
    gguf_fields, ...)."""
    def deco(fn: Callable[[Mapping], ModelConfig]) -> Callable[[Mapping], ModelConfig]:
        tbl = tuple(table)
        arch = Arch(name, hf_class, gguf_arch, tbl, tuple(ignore), fn, **data,
                    _compiled=tuple((_compile(p), t) for p, t in tbl))
        ARCHITECTURES[hf_class] = arch
        if gguf_arch is not None:
            GGUF_ARCHITECTURES.setdefault(gguf_arch, arch)
        return fn
    return deco


def arch_for_hf(config_json: Mapping) -> Arch:
    classes = config_json.get("architectures") or []
    for cls in classes:
        if cls in ARCHITECTURES:
            return ARCHITECTURES[cls]
    shown = ", ".join(classes) if classes else f"model_type={config_json.get('model_type')!r}"
    raise SourceError(f"unsupported architecture {shown} (supported: {', '.join(sorted(ARCHITECTURES))})")


def arch_for_gguf(gguf_arch: str) -> Arch:
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise SourceError(f"unsupported GGUF architecture {gguf_arch!r} "
                          f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))})")
    return GGUF_ARCHITECTURES[gguf_arch]


def expected_tensors(cfg: ModelConfig) -> list[str]:
    """Every canonical tensor a checkpoint of this config must hold, in a stable order."""
    layer_norm = cfg.norm == "layer"
    names = ["token_embd.weight"]
    if cfg.pos == "learned":
        names.append("position_embd.weight")
    if cfg.d_embed and cfg.d_embed != cfg.d_model:
        names += ["proj_in.weight", "proj_out.weight"]
    names += ["output_norm.weight"] + (["output_norm.bias"] if layer_norm else [])
    if not cfg.tied_embeddings:
        names.append("output.weight")
    for i in range(cfg.n_layers):
        parts = [("attn_norm", layer_norm), ("attn_q", cfg.attn_qkv_bias), ("attn_k", cfg.attn_qkv_bias),
                 ("attn_v", cfg.attn_qkv_bias), ("attn_output", cfg.attn_out_bias)]
        if cfg.qk_norm:
            parts += [("attn_q_norm", False), ("attn_k_norm", False)]
        if cfg.sandwich_norm:
            parts.append(("post_attention_norm", False))
        parts.append(("ffn_norm", layer_norm))
        if cfg.n_experts:
            parts += [(part, False) for part in moe_parts(cfg.n_ff_shared)]
        else:
            parts += [("ffn_gate", False)] if cfg.glu else []
            parts += [("ffn_up", cfg.ffn_bias), ("ffn_down", cfg.ffn_bias)]
        if cfg.sandwich_norm:
            parts.append(("post_ffw_norm", False))
        for part, bias in parts:
            names.append(f"blk.{i}.{part}.weight")
            if bias:
                names.append(f"blk.{i}.{part}.bias")
    return names


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


_LLAMA_ATTENTION = (
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    ("model.layers.{i}.self_attn.q_proj.{wb}", "blk.{i}.attn_q.{wb}"),
    ("model.layers.{i}.self_attn.k_proj.{wb}", "blk.{i}.attn_k.{wb}"),
    ("model.layers.{i}.self_attn.v_proj.{wb}", "blk.{i}.attn_v.{wb}"),
    ("model.layers.{i}.self_attn.o_proj.{wb}", "blk.{i}.attn_output.{wb}"),
    ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight"),
)
_LLAMA_TABLE = _LLAMA_ATTENTION + (
    ("model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight"),
)
_ROTARY_BUFFERS = ("model.rotary_emb.inv_freq", "model.layers.{i}.self_attn.rotary_emb.inv_freq")


@register("LlamaForCausalLM", "llama", _LLAMA_TABLE, _ROTARY_BUFFERS, gguf_arch="llama",
          gguf_permuted_qk=True, gguf_norm_topk=True)
def llama_config(cfg: Mapping) -> ModelConfig:
    bias = bool(cfg.get("attention_bias", False))
    return rope_model(cfg, "llama", bias, bias)


@register("Qwen2ForCausalLM", "qwen2", _LLAMA_TABLE, _ROTARY_BUFFERS, gguf_arch="qwen2")
def qwen2_config(cfg: Mapping) -> ModelConfig:
    """Qwen2: biases on q/k/v only. use_sliding_window is off in released models and refused here."""
    if cfg.get("use_sliding_window"):
        raise SourceError("Qwen2ForCausalLM: use_sliding_window=True is unsupported")
    return rope_model(cfg, "qwen2", True, False)


_QK_NORM = (
    ("model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight"),
    ("model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight"),
)
_QK_NORM_TABLE = _LLAMA_TABLE + _QK_NORM


@register("Qwen3ForCausalLM", "qwen3", _QK_NORM_TABLE, _ROTARY_BUFFERS, gguf_arch="qwen3")
def qwen3_config(cfg: Mapping) -> ModelConfig:
    """Qwen3: QK-norm, head_dim from the config (not d_model / n_heads), no q/k/v bias unless
    attention_bias. use_sliding_window is off in released models and refused here."""
    if cfg.get("use_sliding_window"):
        raise SourceError("Qwen3ForCausalLM: use_sliding_window=True is unsupported")
    bias = bool(cfg.get("attention_bias", False))
    return rope_model(cfg, "qwen3", bias, bias, qk_norm=True)


@register("MistralForCausalLM", "mistral", _LLAMA_TABLE, _ROTARY_BUFFERS)
def mistral_config(cfg: Mapping) -> ModelConfig:
    """Mistral = llama without biases; every layer attends through sliding_window when the
    config has one (Mistral-7B v0.1: 4096)."""
    return rope_model(cfg, "mistral", False, False, **_every_layer_window(cfg, "MistralForCausalLM"))


def _every_layer_window(cfg: Mapping, where: str) -> dict:
    """sliding_window and sliding_layers for a model whose every layer attends through
    config.json's sliding_window (none when it is null)."""
    window = int(cfg.get("sliding_window") or 0)
    layers = tuple(range(int(need(cfg, "num_hidden_layers", where)))) if window else ()
    return dict(sliding_window=window, sliding_layers=layers)


_MIXTRAL_TABLE = _LLAMA_ATTENTION + MIXTRAL_FFN_TABLE
_QWEN_MOE_TABLE = _LLAMA_ATTENTION + _QK_NORM + QWEN_MOE_FFN_TABLE


@register("MixtralForCausalLM", "mixtral", _MIXTRAL_TABLE, _ROTARY_BUFFERS)
def mixtral_config(cfg: Mapping) -> ModelConfig:
    """Mixtral: Mistral attention, top-k experts always renormalised (MixtralTopKRouter)."""
    moe = hf_moe_fields(cfg, "MixtralForCausalLM", "intermediate_size", True)
    return rope_model(cfg, "mixtral", False, False, **moe,
                      **_every_layer_window(cfg, "MixtralForCausalLM"))


@register("Qwen2MoeForCausalLM", "qwen2moe", _QWEN_MOE_TABLE, _ROTARY_BUFFERS, gguf_arch="qwen2moe")
def qwen2moe_config(cfg: Mapping) -> ModelConfig:
    """Qwen2-MoE: Qwen2 attention (q/k/v biases: qkv_bias), a shared expert with a sigmoid gate."""
    where = "Qwen2MoeForCausalLM"
    if cfg.get("use_sliding_window"):
        raise SourceError(f"{where}: use_sliding_window=True is unsupported")
    moe = hf_moe_fields(cfg, where, "moe_intermediate_size")
    return rope_model(cfg, "qwen2moe", bool(cfg.get("qkv_bias", True)), False, **moe)


@register("Qwen3MoeForCausalLM", "qwen3moe", _QWEN_MOE_TABLE, _ROTARY_BUFFERS, gguf_arch="qwen3moe",
          gguf_norm_topk=True)
def qwen3moe_config(cfg: Mapping) -> ModelConfig:
    """Qwen3-MoE: Qwen3's per-head QK-norm, no shared expert."""
    where = "Qwen3MoeForCausalLM"
    if cfg.get("use_sliding_window"):
        raise SourceError(f"{where}: use_sliding_window=True is unsupported")
    moe = hf_moe_fields(cfg, where, "moe_intermediate_size")
    bias = bool(cfg.get("attention_bias", False))
    return rope_model(cfg, "qwen3moe", bias, bias, qk_norm=True, **moe)


@register("OlmoeForCausalLM", "olmoe", _QWEN_MOE_TABLE, _ROTARY_BUFFERS, gguf_arch="olmoe",
          gguf_qk_norm_full=True)
def olmoe_config(cfg: Mapping) -> ModelConfig:
    """OLMoE: QK-norm over the whole q / k projection; clip_qkv is refused."""
    where = "OlmoeForCausalLM"
    if cfg.get("clip_qkv") is not None:
        raise SourceError(f"{where}: clip_qkv is unsupported")
    moe = hf_moe_fields(cfg, where, "intermediate_size")
    bias = bool(cfg.get("attention_bias", False))
    return rope_model(cfg, "olmoe", bias, bias, qk_norm=True, qk_norm_full=True, **moe)


_PHI3_TABLE = (
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    ("model.layers.{i}.self_attn.qkv_proj.weight", "blk.{i}.attn_qkv.weight"),
    ("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight"),
    ("model.layers.{i}.mlp.gate_up_proj.weight", "blk.{i}.ffn_up.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight"),
)
# llama.cpp's names for the fused tensors (attn_qkv; ffn_up of 2·n_ff rows, gate first)
_PHI3_FUSED = (("attn_qkv", ("attn_q", "attn_k", "attn_v")), ("ffn_up", ("ffn_gate", "ffn_up")))


@register("Phi3ForCausalLM", "phi3", _PHI3_TABLE, _ROTARY_BUFFERS, gguf_arch="phi3",
          fused=_PHI3_FUSED, gguf_swa_pattern=0)
def phi3_config(cfg: Mapping) -> ModelConfig:
    """Phi-3: fused qkv_proj and gate_up_proj (split at conversion), every layer attending through
    sliding_window when the config has one (as transformers does; llama.cpp ignores it).
    longrope / su scaling (the 128k models) is refused by model/rope.py."""
    return rope_model(cfg, "phi3", False, False, **_every_layer_window(cfg, "Phi3ForCausalLM"))


_GEMMA3_TABLE = (
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight"),
    ("model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight"),
    ("model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight"),
    ("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight"),
    ("model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight"),
    ("model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.post_attention_norm.weight"),
    ("model.layers.{i}.pre_feedforward_layernorm.weight", "blk.{i}.ffn_norm.weight"),
    ("model.layers.{i}.post_feedforward_layernorm.weight", "blk.{i}.post_ffw_norm.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight"),
)


@register("Gemma3ForCausalLM", "gemma3", _GEMMA3_TABLE, _ROTARY_BUFFERS, gguf_arch="gemma3",
          gguf_swa_pattern=6, norm_shift=1.0, gguf_fields=gemma3_gguf_fields)
def gemma3_config(cfg: Mapping) -> ModelConfig:
    """Gemma 3's text model (model/gemma3.py)."""
    return gemma3_hf_config(cfg)


_OPT_TABLE = (
    ("{m}decoder.embed_tokens.weight", "token_embd.weight"),
    ("{m}decoder.embed_positions.weight", "position_embd.weight"),
    ("{m}decoder.project_in.weight", "proj_in.weight"),
    ("{m}decoder.project_out.weight", "proj_out.weight"),
    ("{m}decoder.final_layer_norm.{wb}", "output_norm.{wb}"),
    ("lm_head.weight", "output.weight"),
    ("{m}decoder.layers.{i}.self_attn_layer_norm.{wb}", "blk.{i}.attn_norm.{wb}"),
    ("{m}decoder.layers.{i}.self_attn.q_proj.{wb}", "blk.{i}.attn_q.{wb}"),
    ("{m}decoder.layers.{i}.self_attn.k_proj.{wb}", "blk.{i}.attn_k.{wb}"),
    ("{m}decoder.layers.{i}.self_attn.v_proj.{wb}", "blk.{i}.attn_v.{wb}"),
    ("{m}decoder.layers.{i}.self_attn.out_proj.{wb}", "blk.{i}.attn_output.{wb}"),
    ("{m}decoder.layers.{i}.final_layer_norm.{wb}", "blk.{i}.ffn_norm.{wb}"),
    ("{m}decoder.layers.{i}.fc1.{wb}", "blk.{i}.ffn_up.{wb}"),
    ("{m}decoder.layers.{i}.fc2.{wb}", "blk.{i}.ffn_down.{wb}"),
)


@register("OPTForCausalLM", "opt", _OPT_TABLE)
def opt_config(cfg: Mapping) -> ModelConfig:
    """OPT: pre-LayerNorm, ReLU FFN (fc1 = up, fc2 = down), learned positions offset by 2."""
    where = "OPTForCausalLM"
    if not cfg.get("do_layer_norm_before", True):
        raise SourceError(f"{where}: do_layer_norm_before=False (post-LayerNorm OPT-350m) is unsupported")
    if cfg.get("_remove_final_layer_norm") or not cfg.get("layer_norm_elementwise_affine", True):
        raise SourceError(f"{where}: OPT without final/affine layer norms is unsupported")
    act = cfg.get("activation_function", "relu")
    if act != "relu":
        raise SourceError(f"{where}: activation_function {act!r} is unsupported (only relu)")
    d_model = int(need(cfg, "hidden_size", where))
    n_heads = int(need(cfg, "num_attention_heads", where))
    d_embed = int(cfg.get("word_embed_proj_dim") or d_model)
    bias = bool(cfg.get("enable_bias", True))
    return ModelConfig(
        arch="opt", vocab_size=int(need(cfg, "vocab_size", where)), d_model=d_model,
        n_layers=int(need(cfg, "num_hidden_layers", where)), n_heads=n_heads, n_kv_heads=n_heads,
        head_dim=d_model // n_heads, n_ff=int(need(cfg, "ffn_dim", where)),
        context_length=int(need(cfg, "max_position_embeddings", where)),
        norm="layer", norm_eps=1e-5, act="relu", glu=False, pos="learned", pos_offset=2,
        d_embed=d_embed if d_embed != d_model else 0,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attn_qkv_bias=bias, attn_out_bias=bias, ffn_bias=bias,
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids(cfg.get("eos_token_id")),
    ).validate()
