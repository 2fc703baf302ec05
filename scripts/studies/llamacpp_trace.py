"""llama.cpp's intermediate tensors of one forward pass, by the names its graph gives them.

Run:  python -m scripts.studies.llamacpp_trace GGUF --text "Once upon a time" [--names attn_norm-0,...]
      prints each captured tensor's name, shape and a few values.
As a module: capture(gguf, token_ids, want) -> {name: array (ne3, ne2, ne1, ne0) f32}.

llama.cpp's scheduler calls the context's cb_eval for every node of the graph (ask=true: "do you
want it?", then ask=false once it is computed); the tensors live in host memory on the CPU
backend, so the callback copies them out. Names are llama.cpp's (`attn_norm-3`, `Qcur-3`,
`ffn_out-3`, `result_output`, ...; src/models/*.cpp and src/llama-graph.cpp). Only F32 and F16
tensors are copied. The KV cache is f16 and flash attention off: llama-cpp-python's defaults,
as the fixtures (scripts/fixtures/make_llamacpp_fixtures.py).
"""
from __future__ import annotations

import argparse
import ctypes
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

import numpy as np


class GgmlTensor(ctypes.Structure):
    """ggml.h's struct ggml_tensor (GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10,
    GGML_MAX_NAME 64)."""
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
                ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int),
                ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
                ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p),
                ("name", ctypes.c_char * 64), ("extra", ctypes.c_void_p),
                ("padding", ctypes.c_char * 8)]


GGML_F32, GGML_F16 = 0, 1


def tensor_array(t: GgmlTensor) -> np.ndarray:
    """A copy of t's data as (ne3, ne2, ne1, ne0) f32 (F16 widened), strides honoured."""
    dt = {GGML_F32: np.float32, GGML_F16: np.float16}[t.type]
    ne, nb = list(t.ne), list(t.nb)
    span = sum((n - 1) * s for n, s in zip(ne, nb)) + np.dtype(dt).itemsize
    buf = (ctypes.c_uint8 * span).from_address(t.data)
    view = np.ndarray(shape=tuple(ne[::-1]), dtype=dt, buffer=buf, strides=tuple(nb[::-1]))
    return np.array(view, dtype=np.float32)


def eval_callback(fn: Callable[[GgmlTensor, bool], bool]):
    """Every llama context made inside gets cb_eval = fn(tensor, ask) -> bool (the ctypes
    callback lives as long as the context manager)."""
    import llama_cpp.llama_cpp as lib
    from scripts.llamacpp_params import patched_defaults
    cb = lib.ggml_backend_sched_eval_callback(
        lambda t, ask, _ud: bool(fn(ctypes.cast(t, ctypes.POINTER(GgmlTensor)).contents, ask)))
    return patched_defaults("llama_context_default_params", lambda p: setattr(p, "cb_eval", cb))


def capture(gguf: Path, token_ids: Sequence[int], want: Callable[[str], bool],
            n_threads: int = 2, into: Optional[list] = None) -> Dict[str, np.ndarray]:
    """{name: (ne3, ne2, ne1, ne0) f32} of the F32 / F16 tensors whose name want() accepts, from
    one batch of token_ids at positions 0.., llama.cpp's defaults (f16 KV, no flash attention,
    no repacked weights), logits of every position; "logits": (T, vocab) too. into: a list that
    gets every (name, array) in compute order (a name may repeat)."""
    import llama_cpp
    from scripts.llamacpp_params import no_extra_bufts
    got: Dict[str, np.ndarray] = {}

    def on_tensor(t: GgmlTensor, ask: bool) -> bool:
        name = t.name.decode(errors="replace")
        if ask:
            return want(name) and t.type in (GGML_F32, GGML_F16)
        if want(name) and t.type in (GGML_F32, GGML_F16):
            got[name] = tensor_array(t)
            if into is not None:
                into.append((name, got[name]))
        return True

    n_ctx = max(64, len(token_ids))
    with no_extra_bufts(), eval_callback(on_tensor):
        llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                              n_threads=n_threads, n_threads_batch=n_threads, logits_all=True,
                              verbose=False)
    try:
        llm.eval(list(token_ids))
        got["logits"] = np.array(llm.scores[:len(token_ids)], dtype=np.float32)   # (T, vocab)
    finally:
        llm.close()
    return got


def tokenize(gguf: Path, text: str) -> list:
    """llama.cpp's token ids of text (BOS as the vocabulary says, special tokens parsed)."""
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    try:
        return llm.tokenize(text.encode(), add_bos=llm._model.add_bos_token(), special=True)
    finally:
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--text", default="The quick brown fox jumps over the lazy dog.")
    ap.add_argument("--names", default="", help="comma-separated names (default: all)")
    args = ap.parse_args()
    names = set(filter(None, args.names.split(",")))
    ids = tokenize(args.gguf, args.text)
    got = capture(args.gguf, ids, lambda n: not names or n in names)
    for name, a in got.items():
        print(f"{name:24s} {tuple(a.shape)}  {a.reshape(-1)[:4]}")


if __name__ == "__main__":
    main()
