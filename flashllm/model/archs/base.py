"""An architecture as data (Arch) and the decorator that registers one (model/archs/__init__.py
holds the registry and its lookups; each family's file registers its architectures).

An Arch holds what the converter and the runtime switch on for it:
- names: its ModelConfig.arch, the Hugging Face classes (config.json "architectures") and the
  GGUF `general.architecture` values it reads;
- its tensor table: Hugging Face name patterns -> canonical names (model/archs/tensors.py, which
  gives each canonical tensor its shape rule and when a model holds it), and the HF buffers that
  carry no weights; patterns use `{i}` for a layer number, `{wb}` for "weight" or "bias", `{m}`
  for an optional leading "model." and `{e}` for an expert's number (the experts of a layer
  become one (n_experts, ...) tensor);
- config.json -> ModelConfig (the registered function) and GGUF metadata -> ModelConfig
  (model/archs/gguf.py reads the common keys; `gguf_fields` adds the fields llama.cpp fixes per
  architecture);
- a chat template for its files that carry none (generation/chat_template.py);
- conversion behaviour: fused tensors split into parts, norms scaled by (shift + w) folded into
  w, llama.cpp's RoPE permutation of llama-GGUF attn_q / attn_k undone, the GGUF defaults
  llama.cpp assumes (sliding-window pattern, top-k renormalisation, whole-projection QK-norm).
Everything the forward pass does differently is a ModelConfig field (model/config.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from flashllm.errors import SourceError
from flashllm.model.archs.tensors import CANONICAL, part_rows
from flashllm.model.config import ModelConfig

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
    hf_classes: tuple[str, ...]                 # config.json "architectures", e.g. LlamaForCausalLM
    gguf_archs: tuple[str, ...]                 # general.architecture values it reads
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
    chat_turns: tuple[str, str] | None = None   # (family, Jinja template): the family's turn
                                                # markers, for a file that carries no template
    _compiled: tuple = field(default=(), compare=False, repr=False)

    @property
    def gguf_arch(self) -> str | None:
        """The GGUF metadata prefix of this architecture's keys (its first GGUF name)."""
        return self.gguf_archs[0] if self.gguf_archs else None

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
        raise SourceError(f"tensor {hf_name!r} is not mapped by the {self.hf_classes[0]} table "
                          f"(flashllm/model/archs/); refusing to skip it silently")


def _check_table(name: str, table: tuple, fused: tuple) -> None:
    """Every canonical template of a table names a canonical tensor (or a fused one's name)."""
    fused_names = {f"{t}.weight" for t, _ in fused}
    for pattern, template in table:
        leaf = re.sub(r"^blk\.\{i\}\.", "", template)
        for wb in ("weight", "bias"):
            canon = leaf.replace("{wb}", wb)
            if canon not in CANONICAL and canon not in fused_names and \
                    (wb == "weight" or "{wb}" not in leaf):
                raise ValueError(f"arch {name}: {pattern!r} -> {template!r} names no canonical "
                                 f"tensor (model/archs/tensors.py)")


REGISTRY: dict[str, Arch] = {}      # ModelConfig.arch -> Arch, filled by @register at import


def register(name: str, hf_classes: Iterable[str], table: Iterable[tuple[str, str]],
             ignore: Iterable[str] = (), gguf_archs: Iterable[str] = (), **data):
    """Decorator: register `fn(config_json) -> ModelConfig` as architecture `name` with its
    tensor table; `data` sets the other Arch fields (gguf_permuted_qk, fused, ...). A name, HF
    class or GGUF name registered twice is an error."""
    def deco(fn: Callable[[Mapping], ModelConfig]) -> Callable[[Mapping], ModelConfig]:
        tbl = tuple(table)
        _check_table(name, tbl, tuple(data.get("fused", ())))
        arch = Arch(name, tuple(hf_classes), tuple(gguf_archs), tbl, tuple(ignore), fn, **data,
                    _compiled=tuple((_compile(p), t) for p, t in tbl))
        for kind in ("name", "hf_classes", "gguf_archs"):
            mine = {getattr(arch, kind)} if kind == "name" else set(getattr(arch, kind))
            taken = {getattr(a, kind) for a in REGISTRY.values()} if kind == "name" else \
                {n for a in REGISTRY.values() for n in getattr(a, kind)}
            if mine & taken:
                raise ValueError(f"arch {name}: {kind} {sorted(mine & taken)} already registered")
        REGISTRY[name] = arch
        return fn
    return deco
