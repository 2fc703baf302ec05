"""llama.cpp's dense speed on a GGUF file: the peer row of flashllm's benchmark table.

Run:  python -m scripts.bench.llamacpp [--model GGUF]   (default: the user cache's smollm2-135m.gguf)
Measures, with llama-cpp-python (mmap, use_extra_bufts off, or --repack: its default of weights
repacked into anonymous memory; 2 threads), the median of --reps runs:
  pp64   prefill tokens/s: one batch of a 64-token prompt
  tg128  decode tokens/s: 128 tokens, one at a time, after that 64-token prompt
The prompt is 64 fixed token ids (no tokenizer involved), so runs are comparable across models.
Prints one markdown table row (with its header) on stdout, or with --json one JSON object.
--no-warmup measures from whatever the page cache holds (bench.py runs it cold under a cgroup cap
through cgroup_run.py); --n-gen shortens the decode for slow capped runs.

llama.cpp's OpenMP threads spin-wait between ops by default. On an idle machine that is its best
setting; when other processes share the 2 cores it collapses (measured here: tg128 2.4 tok/s
spinning vs 24.5 passive under a load average of ~5). --omp-wait-policy passive sets
OMP_WAIT_POLICY before llama.cpp loads; the row says which policy was used.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

N_PROMPT = 64
N_GEN = 128


def load(path: Path, threads: int, n_ctx: int, repack: bool = False):
    """llama.cpp on path: file-backed (use_extra_bufts off, see scripts/llamacpp_params.py), or
    with repack its default, the weights repacked into anonymous memory for its CPU kernels."""
    import contextlib
    import llama_cpp
    from scripts.llamacpp_params import no_extra_bufts
    with contextlib.nullcontext() if repack else no_extra_bufts():
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads,
                              n_threads_batch=threads, n_batch=N_PROMPT, verbose=False)
    assert bool(llm.model_params.use_extra_bufts) == repack
    return llm


def one_run(llm, prompt: list, n_gen: int = N_GEN) -> tuple:
    """(prefill tok/s, decode tok/s) of one pp64 + tg{n_gen} run from an empty KV cache."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    token = prompt[-1]
    for _ in range(n_gen):
        llm.eval([token])
        token = (token * 31 + 7) % 1000 + 100  # any valid id: speed does not depend on it
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), n_gen / (t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a GGUF file (default: the user cache's "
                    "models/smollm2-135m.gguf, as `flashllm pull smollm2-135m` writes it)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--omp-wait-policy", choices=["default", "active", "passive"], default="default")
    ap.add_argument("--n-prompt", type=int, default=N_PROMPT)
    ap.add_argument("--n-gen", type=int, default=N_GEN)
    ap.add_argument("--no-warmup", action="store_true", help="measure the first run (cold cache)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--repack", action="store_true", help="llama.cpp's default: weights repacked "
                    "into anonymous memory (else file-backed, as under a memory cap)")
    args = ap.parse_args()
    if args.model is None:       # flashllm only here: bench.py passes --model to capped runs
        from flashllm.cli.app import cache_dir
        args.model = cache_dir() / "models" / "smollm2-135m.gguf"
    if args.omp_wait_policy != "default":
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()  # read when libgomp loads
    import llama_cpp
    llm = load(args.model, args.threads, args.n_prompt + args.n_gen + 8, args.repack)
    prompt = np.random.default_rng(0).integers(100, 1100, args.n_prompt).tolist()  # (n_prompt,)
    if not args.no_warmup:
        one_run(llm, prompt, args.n_gen)  # warm-up: page the weights in
    runs = [one_run(llm, prompt, args.n_gen) for _ in range(args.reps)]
    print(f"runs (pp{args.n_prompt}, tg{args.n_gen} tok/s): "
          + ", ".join(f"({a:.2f}, {b:.2f})" for a, b in runs), file=sys.stderr)
    pp = statistics.median(r[0] for r in runs)
    tg = statistics.median(r[1] for r in runs)
    if args.json:
        print(json.dumps({"engine": f"llama.cpp {llama_cpp.__version__}", "model": args.model.name,
                          "threads": args.threads, "omp_wait": args.omp_wait_policy,
                          "weights": "repacked" if args.repack else "file-backed",
                          "n_prompt": args.n_prompt, "n_gen": args.n_gen, "warmup": not args.no_warmup,
                          "runs": runs, "prefill_tps": pp, "decode_tps": tg}))
        llm.close()
        return
    print("| engine | model | threads | OMP wait | pp64 tok/s | tg128 tok/s |")
    print("|---|---|---|---|---|---|")
    weights = "repacked" if args.repack else "mmap"
    print(f"| llama.cpp {llama_cpp.__version__} (dense, {weights}) | {args.model.name} | "
          f"{args.threads} | {args.omp_wait_policy} | {pp:.1f} | {tg:.1f} |")
    llm.close()


if __name__ == "__main__":
    main()
