"""Shared fixtures: tiny transformers checkpoints (built offline) and real models (session-scoped)."""
from __future__ import annotations

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
