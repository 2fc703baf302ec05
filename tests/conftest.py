"""Shared fixtures: tiny transformers checkpoints (built offline) and real models (session-scoped)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

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

# models.toml name -> file name in the local models folder, used when present instead of a pull
LOCAL_GGUF = {"smollm2-135m": "smollm2-135m.gguf", "qwen2.5-coder-0.5b": "qwen05.gguf"}


def _local_models_dir() -> Path:
    return Path(os.environ.get("FLASHLLM_TEST_MODELS", "/work/models"))


def _converted(name: str, dtype: str, log) -> Path:
    """cache_dir/converted/NAME-DTYPE (where `flashllm run NAME` looks), converted once: from
    the local GGUF when there is one, else pulled through the registry."""
    from flashllm.cli import cache_dir, registry_path
    from flashllm.convert import convert
    from flashllm.registry import resolve_model
    out = cache_dir() / "converted" / f"{name}-{dtype}"
    local = _local_models_dir() / LOCAL_GGUF[name]
    if not (out / "manifest.json").is_file() and local.is_file():
        log(f"converting {local} to {out} ({dtype})")
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(local, out, dtype, force=out.exists())
    return resolve_model(name, cache_dir(), registry_path(), log=log, dtype=dtype)


@pytest.fixture(scope="session")
def real_model():
    """load(name, dtype="f32") -> flashllm Model (n_ctx 256, 2 threads) of a models.toml model,
    converted once into the user cache. Loaded models are kept for the session."""
    from flashllm.bundle import open_flash
    from flashllm.model import Model
    loaded = {}

    def load(name: str, dtype: str = "f32"):
        if (name, dtype) not in loaded:
            path = _converted(name, dtype, log=lambda m: print(m, file=sys.stderr))
            loaded[name, dtype] = Model(open_flash(path), n_threads=2, n_ctx=256)
        return loaded[name, dtype]

    return load
