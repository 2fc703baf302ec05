"""Does the self draft need every down column its cached neurons pass? (issue 15, session 31)

The draft's FFN (runtime/resident.py) runs each layer's cached neurons with the layer's
calibrated threshold: a neuron whose |h| passes it adds its down column. About half of them
pass on a token, and those down axpys are half the draft's FFN time (docs/MEASUREMENTS.md,
"Session 30"). A draft is only a guess, so it could keep fewer: this measures, teacher-forced
over the built-in evaluation split (code, then prose), how often the draft's argmax is the whole
model's and the draft's milliseconds a token, with its thresholds scaled by each of --scales
(the whole model keeps its own). The draft borrows cold output as the runtime does (ColdCarry,
fitted from the model's passes); both use the whole output head.

    python -m scripts.studies.draft_threshold $FLASHLLM_CACHE/converted/qwen2.5-coder-1.5b-native-cal \\
        --hot 4544 --positions 192 --scales 1,1.5,2,3
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from flashllm.format.reader import open_flash
from flashllm.generation.tokenizer import Tokenizer
from flashllm.runtime.model import Model
from flashllm.runtime.resident import ColdCarry
from flashllm.sparsity.activations import manifest_thresholds
from flashllm.sparsity.calibrate import text_tokens
from flashllm.sparsity.corpus import builtin_text
from scripts.studies.draft_cold import Strategy
from scripts.studies.draft_order import SubsetFfn


def agreement(flash, sub: SubsetFfn, draft_sub: SubsetFfn, hot, cold, ids: list,
              threads: int) -> tuple[int, float]:
    """(positions of ids where the draft's argmax is the model's, the draft's ms a token)."""
    cfg = flash.config
    carry = ColdCarry(cfg.n_layers, cfg.d_model)
    full = Strategy(sub, hot, cold, carry=carry)
    model = Model(flash, n_threads=threads, n_ctx=len(ids), ffn=full)
    draft = model.sibling(Strategy(draft_sub, hot, source=full, carry=carry), model.w)
    hits, seconds = 0, 0.0
    for pos, t in enumerate(ids):
        t0 = time.perf_counter()
        d = draft.forward(np.array([t], np.int32), pos)[0]                 # (vocab,)
        seconds += time.perf_counter() - t0
        m = model.forward(np.array([t], np.int32), pos)[0]                 # (vocab,)
        hits += int(np.argmax(d) == np.argmax(m))
    return hits, 1000 * seconds / len(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--hot", type=int, default=4544, help="cached neurons a layer (560 MiB's plan)")
    ap.add_argument("--positions", type=int, default=192)
    ap.add_argument("--scales", default="1,1.5,2,3")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    flash = open_flash(a.model)
    cfg = flash.config
    layers = [np.ascontiguousarray(flash.read_ffn_layer(i))               # (n_ff, stride) each
              for i in range(cfg.n_layers)]
    thr = np.asarray(manifest_thresholds(flash.manifest, cfg.n_layers), np.float32)  # (L,)
    sub = SubsetFfn(flash, layers, thr, a.threads)
    hot, cold = np.arange(a.hot, dtype=np.int32), np.arange(a.hot, cfg.n_ff, dtype=np.int32)
    tok, n = Tokenizer.from_flash(flash), a.positions // 2
    texts = [text_tokens(tok, builtin_text("evaluation", k).text, n) for k in ("code", "prose")]
    for scale in (float(s) for s in a.scales.split(",")):
        draft_sub = SubsetFfn(flash, layers, thr * scale, a.threads)
        (c, c_ms), (p, p_ms) = (agreement(flash, sub, draft_sub, hot, cold, ids, a.threads)
                                for ids in texts)
        print(f"draft thresholds x{scale}: draft = model on code {c}/{n} ({c_ms:.1f} ms a "
              f"token), prose {p}/{n} ({p_ms:.1f} ms)", flush=True)


if __name__ == "__main__":
    main()
