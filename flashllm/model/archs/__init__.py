"""The architectures: one file per family, each registering its Arch (base.py) with @register,
and the lookups by ModelConfig.arch, Hugging Face class and GGUF name. Every module of this
package is imported here, so a family's file registers itself by being in the folder. This
registry is the only list of architectures (tests/test_archs.py checks that no module outside
model/archs/ names one, or a tensor only some of them hold). docs/ADDING_AN_ARCHITECTURE.md says
how to add one."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Mapping

from flashllm.errors import FormatError, SourceError
from flashllm.model.archs.base import REGISTRY, Arch



def _import_families() -> None:
    """Import every module of this package: each family's @register runs."""
    for family in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        importlib.import_module(f"{__name__}.{family}")


_import_families()


def arch_for_hf(config_json: Mapping) -> Arch:
    """The Arch of a config.json (its first "architectures" class that is registered)."""
    classes = config_json.get("architectures") or []
    by_class = {c: a for a in REGISTRY.values() for c in a.hf_classes}
    for cls in classes:
        if cls in by_class:
            return by_class[cls]
    shown = ", ".join(classes) if classes else f"model_type={config_json.get('model_type')!r}"
    raise SourceError(f"unsupported architecture {shown} (supported: {', '.join(sorted(by_class))})")


def arch_for_gguf(gguf_arch: str) -> Arch:
    """The Arch of a GGUF file's general.architecture."""
    by_name = {g: a for a in REGISTRY.values() for g in a.gguf_archs}
    if gguf_arch not in by_name:
        raise SourceError(f"unsupported GGUF architecture {gguf_arch!r} "
                          f"(supported: {', '.join(sorted(by_name))})")
    return by_name[gguf_arch]


def arch_named(name: str) -> Arch:
    """The Arch of a ModelConfig.arch (a manifest's); FormatError if none is registered."""
    if name not in REGISTRY:
        raise FormatError(f"unsupported architecture {name!r} (supported: {', '.join(REGISTRY)})")
    return REGISTRY[name]
