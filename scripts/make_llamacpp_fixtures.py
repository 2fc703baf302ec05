"""Make the llama.cpp reference fixtures that flashllm's forward pass is checked against.

Run:  /work/venv/bin/python scripts/make_llamacpp_fixtures.py [--models-dir /work/models] [--f32]
Needs llama-cpp-python (the reference) and the real GGUF files; it writes, per model NAME,
tests/fixtures/llamacpp/NAME.npz and NAME.json. Nothing here is computed by flashllm.

With --f32 the fixtures are named NAME-f32 and come from llama.cpp running an F32 re-export of
the GGUF (scripts/make_f32_gguf.py: every tensor dequantized by gguf-py, metadata kept, Q/K as
stored) with an F32 KV cache. llama.cpp then computes in f32 throughout: no 8-bit activation
rounding in quantized dot products, no f16 rounding of K, V, Q or the attention weights (without
flash attention, llama.cpp converts the f32 operand of a mul_mat to the KV cache's type). The
re-export is written to --f32-dir and checked to tokenize every prompt as the original does.

Fixture format
--------------
NAME.json (human-readable):
  model, model_sha256, model_size   the GGUF file the figures come from
  llama_cpp_python, system_info     the reference's version and build
  settings                          n_ctx, n_threads, logits_all, use_extra_bufts, n_batch,
                                    type_k, type_v (KV cache types; "f16" is llama.cpp's default)
  source (--f32 only)               the original GGUF (model, model_sha256, model_size), how it
                                    was re-exported, and tokenization_unchanged: true
  tokenize                          {"add_special": true, "parse_special": true}: llama.cpp's
                                    tokenizer with its own BOS rule (add_bos from the GGUF
                                    metadata; the ids show whether a BOS was added)
  bos_id, add_bos, eos_id           from the GGUF metadata as llama.cpp reads it (add_bos is
                                    false when the key is absent)
  n_positions, top_k, n_greedy      64, 16, 64
  prompts: [{name, kind, text, n_prompt_tokens, greedy_text}]  in the order of the npz keys
NAME.npz (np.load(path, allow_pickle=False)); for each prompt name P in prose, code, chat:
  P.prompt_ids       (n_prompt,) int32   llama.cpp's tokenization of the prompt text
  P.tf_ids           (64,) int32         teacher-forced input: prompt ids + the first
                                         64 - n_prompt tokens of llama.cpp's greedy continuation
  P.tf_top_ids       (64, 16) int32      per position, the 16 highest-logit token ids, best first
  P.tf_top_logits    (64, 16) float32    their logits (raw, before any softmax)
  P.tf_logsumexp     (64,) float32       logsumexp over the full vocabulary at that position
                                         (log-probability of token t = logit_t - logsumexp)
  P.greedy_ids       (64,) int32         64 tokens generated greedily after the prompt
  P.greedy_margin    (64,) float32       at each step, top-1 logit minus top-2 logit (small
                                         margins mark steps where a tie-break may differ)
Row i of the tf arrays holds the logits after tf_ids[: i + 1], i.e. the prediction of token i+1;
all 64 positions were evaluated in one batch (llama.cpp's prefill path). The greedy run evaluates
the prompt in one batch, then one token per step (the decode path).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import jinja2.sandbox
import llama_cpp
import llama_cpp.llama_cpp as llama_lib
import numpy as np

from llamacpp_params import no_extra_bufts
from make_f32_gguf import export as export_f32

N_POS = 64
TOP_K = 16
N_GREEDY = 64
N_CTX = 256
N_THREADS = 2

PROMPTS = [
    ("prose", "text", "The lighthouse keeper climbed the narrow stairs every evening, and on the "
                      "night the storm came he noticed that"),
    ("code", "text", "def binary_search(items, target):\n    \"\"\"Return the index of target in "
                     "the sorted list items, or -1.\"\"\"\n    lo, hi = 0, len(items) - 1\n"
                     "    while lo <= hi:\n        mid ="),
    ("chat", "chat", "Explain in two sentences why the sky is blue."),
]

MODELS = {"smollm2-135m": "smollm2-135m.gguf", "qwen2.5-coder-0.5b": "qwen05.gguf"}




def load(path: Path, f32_kv: bool = False) -> llama_cpp.Llama:
    kv = {"type_k": llama_lib.GGML_TYPE_F32, "type_v": llama_lib.GGML_TYPE_F32} if f32_kv else {}
    with no_extra_bufts():
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=N_CTX, n_threads=N_THREADS,
                              n_threads_batch=N_THREADS, logits_all=True, verbose=False, **kv)
    if llm.model_params.use_extra_bufts:
        raise SystemExit("use_extra_bufts is still on: llama.cpp would repack the weights")
    return llm


def chat_text(llm: llama_cpp.Llama, user: str) -> str:
    """The model's own chat template (GGUF metadata) applied to one user message."""
    meta = llm.metadata
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    template = env.from_string(meta["tokenizer.chat_template"])
    vocab_token = lambda key: llm.detokenize([int(meta[key])], special=True).decode() \
        if key in meta else ""
    return template.render(messages=[{"role": "user", "content": user}],
                           add_generation_prompt=True,
                           bos_token=vocab_token("tokenizer.ggml.bos_token_id"),
                           eos_token=vocab_token("tokenizer.ggml.eos_token_id"))


def greedy(llm: llama_cpp.Llama, prompt: List[int]) -> tuple:
    """N_GREEDY argmax tokens after the prompt and the top-1 minus top-2 logit at each step."""
    llm.reset()
    llm.eval(prompt)
    ids, margins = [], []
    for _ in range(N_GREEDY):
        logits = llm.scores[llm.n_tokens - 1].astype(np.float64)  # (vocab,)
        top2 = np.argsort(-logits, kind="stable")[:2]
        ids.append(int(top2[0]))
        margins.append(logits[top2[0]] - logits[top2[1]])
        llm.eval([ids[-1]])
    return np.array(ids, np.int32), np.array(margins, np.float32)


def teacher_forced(llm: llama_cpp.Llama, tokens: np.ndarray) -> Dict[str, np.ndarray]:
    """Top-k ids and logits and the full-vocab logsumexp at each of the tokens, one batch."""
    llm.reset()
    llm.eval(tokens.tolist())
    logits = llm.scores[: len(tokens)].astype(np.float64)  # (N_POS, vocab)
    top = np.argsort(-logits, axis=1, kind="stable")[:, :TOP_K]  # (N_POS, TOP_K)
    peak = logits.max(axis=1, keepdims=True)  # (N_POS, 1)
    lse = peak[:, 0] + np.log(np.exp(logits - peak).sum(axis=1))  # (N_POS,)
    return {"tf_top_ids": top.astype(np.int32),
            "tf_top_logits": np.take_along_axis(logits, top, axis=1).astype(np.float32),
            "tf_logsumexp": lse.astype(np.float32)}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def prompt_tokens(llm: llama_cpp.Llama) -> List[tuple]:
    """(name, kind, full text, llama.cpp token ids) of each prompt, chat ones templated."""
    out = []
    for pname, kind, text in PROMPTS:
        full = chat_text(llm, text) if kind == "chat" else text
        ids = llm.tokenize(full.encode("utf-8"), add_bos=True, special=True)
        out.append((pname, kind, full, np.array(ids, np.int32)))  # ids: (n_prompt,)
    return out


def run_prompts(llm: llama_cpp.Llama, name: str) -> tuple:
    """The npz arrays and the json prompt entries of every prompt (format in the docstring)."""
    arrays: Dict[str, np.ndarray] = {}
    prompts = []
    for pname, kind, full, prompt in prompt_tokens(llm):
        if len(prompt) >= N_POS:
            raise SystemExit(f"{name}/{pname}: prompt has {len(prompt)} tokens, need < {N_POS}")
        g_ids, g_margin = greedy(llm, prompt.tolist())
        tf_ids = np.concatenate([prompt, g_ids])[:N_POS]  # (N_POS,)
        arrays.update({f"{pname}.prompt_ids": prompt, f"{pname}.tf_ids": tf_ids,
                       f"{pname}.greedy_ids": g_ids, f"{pname}.greedy_margin": g_margin})
        arrays.update({f"{pname}.{k}": v for k, v in teacher_forced(llm, tf_ids).items()})
        greedy_text = llm.detokenize(g_ids.tolist(), special=True).decode("utf-8", "replace")
        prompts.append({"name": pname, "kind": kind, "text": full,
                        "n_prompt_tokens": int(len(prompt)), "greedy_text": greedy_text})
        print(f"{name}/{pname}: {len(prompt)} prompt tokens, min margin "
              f"{g_margin.min():.3f}, continuation {greedy_text[:60]!r}")
    return arrays, prompts


def make(name: str, path: Path, out_dir: Path, source: Optional[dict] = None) -> None:
    """Write NAME.npz and NAME.json from llama.cpp running PATH; `source` (the original GGUF
    of an F32 re-export) also selects an F32 KV cache and is recorded in the json."""
    llm = load(path, f32_kv=source is not None)
    arrays, prompts = run_prompts(llm, name)
    meta = llm.metadata
    kv_type = "f32" if source is not None else "f16"
    info = {
        "model": path.name, "model_sha256": sha256(path), "model_size": path.stat().st_size,
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_lib.llama_print_system_info().decode().strip(),
        "settings": {"n_ctx": N_CTX, "n_threads": N_THREADS, "logits_all": True,
                     "use_extra_bufts": False, "n_batch": llm.n_batch,
                     "type_k": kv_type, "type_v": kv_type},
        "tokenize": {"add_special": True, "parse_special": True},
        "bos_id": int(meta.get("tokenizer.ggml.bos_token_id", -1)),
        "add_bos": meta.get("tokenizer.ggml.add_bos_token") == "true",
        "eos_id": int(meta.get("tokenizer.ggml.eos_token_id", -1)),
        "n_positions": N_POS, "top_k": TOP_K, "n_greedy": N_GREEDY, "prompts": prompts,
    }
    if source is not None:
        info["source"] = source
    out_dir.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out_dir / f"{name}.npz", **arrays)
    (out_dir / f"{name}.json").write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n",
                                          encoding="utf-8")
    llm.close()


def check_same_tokens(original: Path, f32: Path) -> None:
    """llama.cpp tokenizes (and chat-templates) every prompt identically from both files."""
    with no_extra_bufts():
        a = llama_cpp.Llama(model_path=str(original), vocab_only=True, verbose=False)
        b = llama_cpp.Llama(model_path=str(f32), vocab_only=True, verbose=False)
    for (pname, _, text_a, ids_a), (_, _, text_b, ids_b) in zip(prompt_tokens(a), prompt_tokens(b)):
        if text_a != text_b or not np.array_equal(ids_a, ids_b):
            raise SystemExit(f"{f32}: prompt {pname!r} tokenizes differently from {original}")
    a.close()
    b.close()


def make_f32(name: str, original: Path, out_dir: Path, f32_dir: Path) -> None:
    """Fixture NAME-f32: llama.cpp on the F32 re-export of ORIGINAL (made here, into f32_dir)."""
    f32_dir.mkdir(parents=True, exist_ok=True)
    f32_path = f32_dir / f"{name}-f32.gguf"
    export_f32(original, f32_path)
    check_same_tokens(original, f32_path)
    source = {"model": original.name, "model_sha256": sha256(original),
              "model_size": original.stat().st_size,
              "reexport": f"every tensor dequantized to F32 by gguf-py {gguf_version()} "
                          "(scripts/make_f32_gguf.py), metadata kept, file_type ALL_F32, "
                          "Q/K not un-permuted",
              "tokenization_unchanged": True}
    make(f"{name}-f32", f32_path, out_dir, source)


def gguf_version() -> str:
    from importlib.metadata import version
    return version("gguf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models-dir", type=Path, default=Path("/work/models"))
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parent.parent / "tests/fixtures/llamacpp")
    ap.add_argument("--only", choices=sorted(MODELS), help="make one model's fixture")
    ap.add_argument("--f32", action="store_true",
                    help="make the NAME-f32 fixtures from F32 re-exports of the GGUFs")
    ap.add_argument("--f32-dir", type=Path,
                    default=Path(tempfile.gettempdir()) / "flashllm-f32-gguf",
                    help="where the F32 re-exports are written (about 4x the Q4 size)")
    args = ap.parse_args()
    for name, file in MODELS.items():
        if args.only not in (None, name):
            continue
        if args.f32:
            make_f32(name, args.models_dir / file, args.out, args.f32_dir)
        else:
            make(name, args.models_dir / file, args.out)


if __name__ == "__main__":
    main()
