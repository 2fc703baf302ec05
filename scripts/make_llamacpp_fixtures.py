"""Make the llama.cpp reference fixtures that flashllm's forward pass is checked against.

Run:  /work/venv/bin/python scripts/make_llamacpp_fixtures.py [--models-dir /work/models]
Needs llama-cpp-python (the reference) and the real GGUF files; it writes, per model NAME,
tests/fixtures/llamacpp/NAME.npz and NAME.json. Nothing here is computed by flashllm.

Fixture format
--------------
NAME.json (human-readable):
  model, model_sha256, model_size   the GGUF file the figures come from
  llama_cpp_python, system_info     the reference's version and build
  settings                          n_ctx, n_threads, logits_all, use_extra_bufts, n_batch
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
import contextlib
import hashlib
import json
from pathlib import Path
from typing import Dict, Iterator, List

import jinja2.sandbox
import llama_cpp
import llama_cpp.llama_cpp as llama_lib
import numpy as np

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


@contextlib.contextmanager
def no_extra_bufts() -> Iterator[None]:
    """Llama() swallows unknown keyword arguments, so use_extra_bufts=False passed to it is
    silently ignored; set the field on the model params it starts from instead."""
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


def load(path: Path) -> llama_cpp.Llama:
    with no_extra_bufts():
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=N_CTX, n_threads=N_THREADS,
                              n_threads_batch=N_THREADS, logits_all=True, verbose=False)
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


def make(name: str, path: Path, out_dir: Path) -> None:
    llm = load(path)
    arrays: Dict[str, np.ndarray] = {}
    prompts = []
    for pname, kind, text in PROMPTS:
        full = chat_text(llm, text) if kind == "chat" else text
        prompt = np.array(llm.tokenize(full.encode("utf-8"), add_bos=True, special=True), np.int32)
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
    meta = llm.metadata
    info = {
        "model": path.name, "model_sha256": sha256(path), "model_size": path.stat().st_size,
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_lib.llama_print_system_info().decode().strip(),
        "settings": {"n_ctx": N_CTX, "n_threads": N_THREADS, "logits_all": True,
                     "use_extra_bufts": False, "n_batch": llm.n_batch},
        "tokenize": {"add_special": True, "parse_special": True},
        "bos_id": int(meta.get("tokenizer.ggml.bos_token_id", -1)),
        "add_bos": meta.get("tokenizer.ggml.add_bos_token") == "true",
        "eos_id": int(meta.get("tokenizer.ggml.eos_token_id", -1)),
        "n_positions": N_POS, "top_k": TOP_K, "n_greedy": N_GREEDY, "prompts": prompts,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out_dir / f"{name}.npz", **arrays)
    (out_dir / f"{name}.json").write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n",
                                          encoding="utf-8")
    llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models-dir", type=Path, default=Path("/work/models"))
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parent.parent / "tests/fixtures/llamacpp")
    ap.add_argument("--only", choices=sorted(MODELS), help="make one model's fixture")
    args = ap.parse_args()
    for name, file in MODELS.items():
        if args.only in (None, name):
            make(name, args.models_dir / file, args.out)


if __name__ == "__main__":
    main()
