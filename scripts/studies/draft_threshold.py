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

import time

import numpy as np

from flashllm.runtime.model import Model
from flashllm.runtime.resident import ColdCarry
from scripts.studies.draft_cold import Strategy, split, study_args
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
    a = study_args(__doc__, 4544, 192, "--scales", "1,1.5,2,3")
    s = split(a.model, a.hot, a.positions)
    sub = SubsetFfn(s.flash, s.layers, s.thresholds, a.threads)
    n = a.positions // 2
    for scale in (float(x) for x in a.scales.split(",")):
        draft_sub = SubsetFfn(s.flash, s.layers, s.thresholds * scale, a.threads)
        (c, c_ms), (p, p_ms) = (agreement(s.flash, sub, draft_sub, s.hot, s.cold, ids, a.threads)
                                for ids in s.texts)
        print(f"draft thresholds x{scale}: draft = model on code {c}/{n} ({c_ms:.1f} ms a "
              f"token), prose {p}/{n} ({p_ms:.1f} ms)", flush=True)


if __name__ == "__main__":
    main()
