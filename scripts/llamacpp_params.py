"""llama-cpp-python's Llama() silently drops keyword arguments it does not know, so
`Llama(use_extra_bufts=False)` does nothing in 0.3.36 and llama.cpp still repacks the weights into
anonymous memory (which breaks memory-capped runs). `no_extra_bufts()` sets the field on the model
params Llama() starts from instead. llama_cpp is imported lazily, so callers can set OMP_* first."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator


@contextlib.contextmanager
def patched_defaults(factory: str, edit: Callable) -> Iterator[None]:
    """llama_cpp.llama_cpp.<factory> (llama_model_default_params, llama_context_default_params)
    returns its params after edit(params) while inside: the Llama() made there starts from them."""
    import llama_cpp.llama_cpp as llama_lib
    original = getattr(llama_lib, factory)

    def params():
        p = original()
        edit(p)
        return p

    setattr(llama_lib, factory, params)
    try:
        yield
    finally:
        setattr(llama_lib, factory, original)


def no_extra_bufts():
    """Llama() made inside keeps its weights file-backed (use_extra_bufts = False)."""
    return patched_defaults("llama_model_default_params",
                            lambda p: setattr(p, "use_extra_bufts", False))
