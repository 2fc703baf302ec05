"""Make the llama.cpp perplexity fixture that flashllm's `perplexity` is checked against.

Run:  /work/venv/bin/python scripts/make_llamacpp_ppl_fixture.py [--model /work/models/smollm2-135m.gguf]
      [--out FILE] [--n-ctx 256] [--chunks 4] [--text-chars 40000]   (defaults: the test fixture)
Needs llama-cpp-python and the real GGUF. Writes tests/fixtures/llamacpp/smollm2-135m.ppl.json.
Nothing here is computed by flashllm (only the evaluation text comes from flashllm.sparsity.corpus).

What it computes: llama.cpp's perplexity (tools/perplexity/perplexity.cpp, `perplexity()`) with
llama.cpp's own tokenizer and forward pass: tokens = tokenize(text, add_bos per the vocabulary,
special=True), the first N_CHUNKS·N_CTX tokens in chunks of N_CTX, each from an empty KV cache
with its first token replaced by BOS when the vocabulary adds one; NLL of the predictions at
positions N_CTX/2 .. N_CTX-2 (log-softmax in f64 from llama.cpp's logits); PPL = exp(mean NLL).

Fixture fields: model, model_sha256, llama_cpp_python, settings, text (the corpus description),
n_ctx, n_chunks, bos_replaced (BOS id or null), token_ids (N_CHUNKS·N_CTX ints), token_sha256
(sha256 of the ids as little-endian int32), count, mean_nll, ppl, ppl_err, chunk_mean_nll.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

import llama_cpp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
from make_llamacpp_fixtures import no_extra_bufts, sha256  # noqa: E402
from flashllm.sparsity.corpus import code_text, stdlib_dir  # noqa: E402

N_CTX = 256
N_CHUNKS = 4
N_THREADS = 2
TEXT_CHARS = 40000


def load(path: Path, n_ctx: int) -> llama_cpp.Llama:
    with no_extra_bufts():
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=N_THREADS,
                              n_threads_batch=N_THREADS, logits_all=True, verbose=False)
    if llm.model_params.use_extra_bufts:
        raise SystemExit("use_extra_bufts is still on: llama.cpp would repack the weights")
    return llm


def chunk_nll(llm: llama_cpp.Llama, chunk: np.ndarray, bos: int | None) -> np.ndarray:
    """(n_ctx/2 - 1,) NLL of one chunk, llama.cpp's definition."""
    inp = chunk.copy()
    if bos is not None:
        inp[0] = bos
    llm.reset()
    llm.eval(inp.tolist())
    n_ctx = len(chunk)
    first = n_ctx // 2
    z = llm.scores[first:n_ctx - 1].astype(np.float64)                 # (n_ctx - first - 1, vocab)
    m = z.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
    return lse - z[np.arange(len(z)), chunk[first + 1:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("/work/models/smollm2-135m.gguf"))
    ap.add_argument("--out", type=Path, default=ROOT / "tests/fixtures/llamacpp/smollm2-135m.ppl.json")
    ap.add_argument("--n-ctx", type=int, default=N_CTX)
    ap.add_argument("--chunks", type=int, default=N_CHUNKS)
    ap.add_argument("--text-chars", type=int, default=TEXT_CHARS)
    args = ap.parse_args()
    n_ctx, n_chunks = args.n_ctx, args.chunks
    text = code_text("evaluation", stdlib_dir(), max_chars=args.text_chars)
    llm = load(args.model, n_ctx)
    add_bos = llm._model.add_bos_token()
    bos = int(llm.token_bos()) if add_bos else None
    ids = np.array(llm.tokenize(text.text.encode("utf-8"), add_bos=add_bos, special=True), np.int32)
    if len(ids) < n_chunks * n_ctx:
        raise SystemExit(f"the text has {len(ids)} tokens, need {n_chunks * n_ctx}")
    ids = ids[:n_chunks * n_ctx]
    per_chunk = [chunk_nll(llm, ids[c * n_ctx:(c + 1) * n_ctx], bos) for c in range(n_chunks)]
    nll = np.concatenate(per_chunk)
    mean = float(nll.mean())
    ppl = math.exp(mean)
    fixture = {
        "model": args.model.name, "model_sha256": sha256(args.model),
        "llama_cpp_python": llama_cpp.__version__,
        "settings": {"n_ctx": n_ctx, "n_batch": n_ctx, "n_threads": N_THREADS, "logits_all": True,
                     "use_extra_bufts": False},
        "text": text.description, "n_ctx": n_ctx, "n_chunks": n_chunks, "bos_replaced": bos,
        "token_ids": ids.tolist(), "token_sha256": hashlib.sha256(ids.astype("<i4").tobytes()).hexdigest(),
        "count": int(len(nll)), "mean_nll": mean, "ppl": ppl,
        "ppl_err": ppl * math.sqrt(float(nll.var()) / (len(nll) - 1)),
        "chunk_mean_nll": [float(c.mean()) for c in per_chunk],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, indent=1) + "\n", encoding="utf-8")
    print(f"{args.model.name}: PPL = {ppl:.4f} +/- {fixture['ppl_err']:.4f} over {len(nll)} tokens "
          f"(bos {bos}) -> {args.out}")
    llm.close()


if __name__ == "__main__":
    main()
