"""llama-cpp-python's Llama() silently drops keyword arguments it does not know, so
`Llama(use_extra_bufts=False)` does nothing in 0.3.36 and llama.cpp still repacks the weights into
anonymous memory (which breaks memory-capped runs). `no_extra_bufts()` sets the field on the model
params Llama() starts from instead. llama_cpp is imported lazily, so callers can set OMP_* first."""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def no_extra_bufts() -> Iterator[None]:
    import llama_cpp.llama_cpp as llama_lib
    original = llama_lib.llama_model_default_params

    def params():
        p = original()
        p.use_extra_bufts = False
        return p

    llama_lib.llama_model_default_params = params
    try:
        yield
    finally:
        llama_lib.llama_model_default_params = original
