"""llama.cpp's greedy decode speed on a text prompt, plain or with prompt-lookup drafts.

Run:  python -m scripts.bench.llamacpp_text --model GGUF --prompt FILE [--n-gen 128] [--draft 8]
      [--no-warmup] [--omp-wait-policy passive] [--ignore-eos]
llama-cpp-python (mmap, use_extra_bufts off, 2 threads) completes the prompt file's text
(tokenized by llama.cpp, special tokens parsed) with temperature 0; with --draft N it checks the N
tokens its LlamaPromptLookupDecoding (llama-cpp-python's prompt lookup) proposes in each pass
(logits_all on: its verification reads every row's logits).
Prints one JSON object: prefill_tps (prompt tokens / time to the first token), decode_tps (the
tokens after the first / the time after it), n_gen and the text's first 80 characters.
--ignore-eos: the end-of-generation tokens' logits -inf (llama.cpp's --ignore-eos), so the run
makes --n-gen tokens, as `flashllm run --ignore-eos` does.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--prompt", type=Path, required=True)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--draft", type=int, default=0, help="prompt-lookup tokens per pass (0: off)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-warmup", action="store_true", help="measure the first run (cold cache)")
    ap.add_argument("--omp-wait-policy", choices=["default", "passive"], default="default")
    ap.add_argument("--ignore-eos", action="store_true", help="never draw an end-of-generation token")
    args = ap.parse_args()
    if args.omp_wait_policy != "default":
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    from scripts.llamacpp_params import no_extra_bufts
    text = args.prompt.read_text()
    draft = LlamaPromptLookupDecoding(num_pred_tokens=args.draft) if args.draft else None
    with no_extra_bufts():
        vocab_only = llama_cpp.Llama(model_path=str(args.model), vocab_only=True, verbose=False)
        n_prompt = len(vocab_only.tokenize(text.encode(), special=True))
        vocab_only.close()
        n_ctx = n_prompt + args.n_gen + args.draft + 8       # logits_all keeps (n_ctx, vocab) f32
        llm = llama_cpp.Llama(model_path=str(args.model), n_ctx=n_ctx, n_threads=args.threads,
                              n_threads_batch=args.threads, n_batch=64, verbose=False,
                              draft_model=draft, logits_all=draft is not None)
    banned = eog_ids(llm) if args.ignore_eos else None
    runs = []
    for _ in range(1 if args.no_warmup else 2):            # warm-up: page the weights in
        llm.reset()
        t0, stamps, out = time.perf_counter(), [], []
        for chunk in llm.create_completion(text, max_tokens=args.n_gen, temperature=0.0,
                                           top_k=1, stream=True, logits_processor=banned):
            choice = chunk["choices"][0]
            if choice["finish_reason"] is None or choice["text"]:   # not the closing chunk
                stamps.append(time.perf_counter())
                out.append(choice["text"])
        runs.append((t0, stamps, "".join(out)))
    t0, stamps, out = runs[-1]
    n = len(stamps)
    print(json.dumps({"engine": f"llama.cpp {llama_cpp.__version__}", "draft": args.draft,
                      "n_prompt": n_prompt, "n_gen": n,
                      "prefill_tps": n_prompt / (stamps[0] - t0) if n else 0.0,
                      "decode_tps": (n - 1) / (stamps[-1] - stamps[0]) if n > 1 else 0.0,
                      "text": out[:80]}))
    llm.close()


def eog_ids(llm):
    """A logits processor that sets llama.cpp's end-of-generation tokens' logits to -inf."""
    import llama_cpp
    import numpy as np
    vocab = llm._model.vocab
    ids = [t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]

    def ban(_input_ids, scores):
        scores[ids] = -np.inf
        return scores
    return llama_cpp.LogitsProcessorList([ban])


if __name__ == "__main__":
    main()
