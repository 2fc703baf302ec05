"""Shared fixtures: tiny transformers checkpoints (built offline) and real models (session-scoped)."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import pytest

from hf_tiny import make_tiny, require_transformers


@pytest.fixture(scope="session")
def hf_tiny(tmp_path_factory):
    """make(name) -> (folder, transformers model): the tiny checkpoint `name` of hf_tiny.TINY,
    written once per session. Skips when torch/transformers are missing."""
    require_transformers()
    built = {}

    def make(name: str):
        if name not in built:
            built[name] = make_tiny(name, tmp_path_factory.mktemp(f"hf_{name}"))
        return built[name]

    return make


# ---- real models (llama.cpp parity) -----------------------------------------------------------

def local_gguf(name: str) -> Optional[Path]:
    """FLASHLLM_TEST_MODELS/NAME.gguf (a folder of GGUF files named by their models.toml names),
    when that variable is set and the file is there."""
    folder = os.environ.get("FLASHLLM_TEST_MODELS")
    path = Path(folder) / f"{name}.gguf" if folder else None
    return path if path and path.is_file() else None


def cached_gguf(name: str) -> Optional[Path]:
    """The GGUF file of models.toml model `name` if it is already on this machine (the local
    copy, or where `flashllm pull` keeps it in the user cache); None otherwise, nothing fetched."""
    from flashllm.cli.app import cache_dir
    pulled = cache_dir() / "models" / f"{name}.gguf"
    return local_gguf(name) or (pulled if pulled.is_file() else None)


def gguf_path(name: str, log=lambda m: print(m, file=sys.stderr)) -> Path:
    """The GGUF file of models.toml model `name`: the local copy if present, else pulled (once)
    through the registry into the user cache."""
    from flashllm.cli.app import cache_dir, registry_path
    from flashllm.convert.registry import load_registry, pull
    return local_gguf(name) or pull(load_registry(registry_path()).get(name), cache_dir(), log)


def _converted(name: str, dtype: str, log) -> Path:
    """cache_dir/converted/NAME-DTYPE (where `flashllm run NAME` looks), converted once."""
    from flashllm.cli.app import cache_dir
    from flashllm.convert.convert import convert
    from flashllm.format.reader import open_flash
    from flashllm.errors import FormatError
    from flashllm.convert.recipe import coarser, outdated
    out = cache_dir() / "converted" / f"{name}-{dtype}"
    try:
        m = open_flash(out).manifest                  # a native conversion of an older recipe
        why = outdated(m) or coarser(m)
        if why is None:
            return out
        log(f"{out}: {why}")
    except FormatError as e:   # absent, or made by an older converter
        log(f"{out}: {e}")
    src = gguf_path(name, log)
    log(f"converting {src} to {out} ({dtype})")
    out.parent.mkdir(parents=True, exist_ok=True)
    convert(src, out, dtype, force=out.exists())
    return out


def plan_run(path: Path, opts, n_ctx: int, process: int):
    """The plan `run` chooses for the converted folder at path (runtime/plan.choose_plan)."""
    from flashllm.format.manifest import read_manifest
    from flashllm.runtime.plan import choose_plan
    return choose_plan(read_manifest(path), opts, n_ctx, process).plan


@pytest.fixture(scope="session")
def real_model():
    """load(name, dtype="f32") -> flashllm Model (n_ctx 256) of a models.toml model, converted
    once into the user cache. Loaded models are kept for the session. One thread: on this shared
    2-core machine a 2-thread kernel slows down ~10x whenever another process holds a core."""
    from flashllm.format.reader import open_flash
    from flashllm.runtime.model import Model
    loaded = {}

    def load(name: str, dtype: str = "f32"):
        if (name, dtype) not in loaded:
            path = _converted(name, dtype, log=lambda m: print(m, file=sys.stderr))
            loaded[name, dtype] = Model(open_flash(path), n_threads=1, n_ctx=256)
        return loaded[name, dtype]

    return load


def pytest_report_header(config) -> str:
    from flashllm.cli.app import cache_dir
    return (f"flashllm: real models are fetched and converted once into {cache_dir()} "
            "(several GB; `make clean-cache` removes them)")
