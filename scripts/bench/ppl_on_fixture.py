"""flashllm's perplexity on the exact token ids of a llama.cpp perplexity fixture.

Run:  python -m scripts.bench.ppl_on_fixture MODEL FIXTURE [--sparsity S [--corpus KIND] |
      --calibrated | --bundles]
FIXTURE: made by scripts/fixtures/make_llamacpp_ppl_fixture.py (llama.cpp's tokens, chunking and
PPL). Scores the same ids with flashllm.generation.perplexity (llama.cpp's definition, the
fixture's BOS replacement), dense, over the bundles with no term dropped (--bundles: what a
budgeted run multiplies, before any threshold), with the layer thresholds `flashllm perplexity
--sparsity S` uses (the manifest's when calibrated for S, else computed on 2048 tokens of the
shipped calibration text --corpus: code by default, or a kind or the mix calibrate reads), or
(--calibrated) the thresholds `flashllm calibrate` stored in the manifest, which every `run
--dram-budget` of that model applies; and prints one JSON line with both perplexities and their
ratio: a comparison on identical tokens, which `flashllm perplexity FILE` (its own tokenizer
over its own text) cannot promise.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from flashllm.format.reader import open_flash
from flashllm.sparsity.activations import manifest_thresholds
from flashllm.sparsity.calibrate import thresholds_for
from flashllm.sparsity.corpus import KINDS, MIX
from flashllm.session.calibration import calibration_texts
from flashllm.runtime.ffn import DenseFfn
from flashllm.runtime.model import Model
from flashllm.generation.perplexity import perplexity
from flashllm.generation.tokenizer import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("fixture", type=Path)
    ap.add_argument("--sparsity", type=float, default=None)
    ap.add_argument("--corpus", choices=(*KINDS, MIX), default="code",
                    help="the calibration text --sparsity's thresholds are computed on")
    ap.add_argument("--calibrated", action="store_true",
                    help="the manifest's thresholds (what a --dram-budget run applies)")
    ap.add_argument("--bundles", action="store_true",
                    help="the FFN over the bundles, no term dropped")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if (args.sparsity is not None) + args.calibrated + args.bundles > 1:
        ap.error("give one of --sparsity, --calibrated and --bundles")
    fx = json.loads(args.fixture.read_text())
    tokens = np.array(fx["token_ids"], dtype=np.int32)                   # (n_chunks * n_ctx,)
    if hashlib.sha256(tokens.astype("<i4").tobytes()).hexdigest() != fx["token_sha256"]:
        raise SystemExit(f"{args.fixture}: token ids do not match their sha256")
    flash = open_flash(args.model)
    ffn = None
    if args.sparsity is not None:
        tok = Tokenizer.from_flash(flash)
        cal = lambda: calibration_texts(tok, None, args.corpus, 2048)[1]      # noqa: E731
        ffn = DenseFfn(flash, args.threads, threshold=thresholds_for(
            flash, args.sparsity, cal, lambda: Model(flash, n_threads=args.threads, n_ctx=512), 512,
            args.threads, lambda m: print(m, file=sys.stderr)))
    if args.calibrated:
        ffn = DenseFfn(flash, args.threads,
                       threshold=manifest_thresholds(flash.manifest, flash.config.n_layers))
    if args.bundles:      # built with thresholds: the bundles; then none dropped
        ffn = DenseFfn(flash, args.threads, threshold=[1.0] * flash.config.n_layers)
        ffn.threshold = [0.0] * flash.config.n_layers
    net = Model(flash, n_threads=args.threads, n_ctx=fx["n_ctx"], ffn=ffn, kv_dtype="f16")  # as `run`
    got = perplexity(net, tokens, n_ctx=fx["n_ctx"], bos_id=fx["bos_replaced"],
                     on_chunk=lambda i, n, p: print(f"[{i}/{n}] {p:.4f}", file=sys.stderr, flush=True))
    print(json.dumps({"model": str(args.model), "sparsity": args.sparsity,
                      "corpus": args.corpus if args.sparsity is not None else None,
                      "calibrated": args.calibrated, "bundles": args.bundles, **got.to_dict(),
                      "llama_cpp_ppl": fx["ppl"], "ratio": got.ppl / fx["ppl"]}))


if __name__ == "__main__":
    main()
