"""Which dtype a native conversion gives each FFN layer's down columns, and whether a converted
folder is what this flashllm makes of its GGUF: from the manifest alone, so resolving a folder to
run imports no converter (convert/native.py makes the columns)."""
from __future__ import annotations

from collections import Counter

from flashllm.format.layout import EXPERT_ROWS, NATIVE, SKETCH, fits
from flashllm.model.tensor import FROM_GGML

FALLBACK = "q8_0"     # the down columns, and what any type the kernel lacks becomes
# a k-quant source's down columns: one k-quant finer (Q6_K: none is; Q2_K / Q3_K: the smallest
# flashllm makes)
KQUANT_DOWN = {"Q2_K": "q4_k", "Q3_K": "q4_k", "Q4_K": "q5_k", "Q5_K": "q6_k", "Q6_K": "q6_k"}
# what flashllm made before: the source's own k-quant (a folder of it is kept, said coarser)
SAME_KQUANT = {"Q2_K": "q4_k", "Q3_K": "q4_k", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}

def down_column(stored: str, d_model: int, kquants: dict = KQUANT_DOWN) -> str:
    """The dtype of a down column of d_model values whose source tensor is a `stored` ggml type:
    the k-quant kquants names for it when d_model is whole superblocks, else q8_0 (f16 when not
    whole blocks of 32)."""
    dt = kquants.get(stored)
    if dt is not None and fits(dt, d_model):
        return dt
    return FALLBACK if fits(FALLBACK, d_model) else "f16"


def keeps_rows(stored: list, n_ff: int) -> bool:
    """Whether down matrices stored in these ggml types (one per layer) are kept as they are
    (down.bin): every layer's type one the kernel has, with n_ff whole blocks of it."""
    return all(fits(FROM_GGML.get(t, ""), n_ff) for t in stored)


def outdated(manifest: dict) -> str | None:
    """Why a native conversion's manifest is not what this flashllm makes of the same GGUF (no
    output head sketch, or a down column in another dtype than down_column chooses: an older
    recipe), or None."""
    if manifest.get("dtype") != NATIVE:
        return None
    if not any(t["name"] == SKETCH for t in manifest["dense"]["tensors"]):
        return "it has no output head sketch"
    if manifest["config"].get("n_experts"):
        return None if manifest["ffn"].get("experts") == EXPERT_ROWS else \
            "its experts are re-quantized q8_0 bundles; this flashllm keeps the GGUF's own rows"
    d = manifest["config"]["d_model"]
    stored = [(o or {}).get("from") for o in _downs(manifest)]
    if "down_rows" not in manifest and keeps_rows(stored, manifest["config"]["n_ff"]):
        return "it lacks the GGUF's own FFN down rows (down.bin), which runs in DRAM multiply"
    for i, o in enumerate(_downs(manifest)):
        made = (down_column(o["from"], d), down_column(o["from"], d, SAME_KQUANT)) if o else ()
        if o and o.get("to") not in made:          # the recipe before is kept (coarser says it)
            return f"layer {i}'s {o['from']} down columns are {o.get('to')}, this flashllm " \
                   f"makes {down_column(o['from'], d)}"
    return None


def coarser(manifest: dict) -> str | None:
    """What a native conversion of the recipe before (down columns in the source's own k-quant,
    SAME_KQUANT) lacks, in a sentence, or None. Kept, not made again: converting takes minutes
    and calibrating the folder again an hour; the user is told (resolve, inspect)."""
    if manifest.get("dtype") != NATIVE or manifest["config"].get("n_experts") or \
            outdated(manifest) is not None:          # experts: their down rows are copied
        return None
    d = manifest["config"]["d_model"]
    older = Counter((o["from"], o["to"]) for o in _downs(manifest)
                    if o and "to" in o and o["to"] != down_column(o["from"], d))
    if not older:
        return None
    layers = ", ".join(f"{n} {src} layers in {to} where this flashllm makes {down_column(src, d)}"
                       for (src, to), n in sorted(older.items()))
    return f"its FFN down columns are an older flashllm's, one k-quant coarser ({layers}: about " \
           "2% more perplexity on prose); to get them, convert its GGUF again (flashllm " \
           "convert GGUF -o FOLDER --force) and calibrate"


def _downs(manifest: dict) -> list:
    """Per FFN layer: the down columns' origin ({"from", "to", ...}), or None."""
    return [(e.get("origin") or {}).get("down") for e in manifest["ffn"]["layers"]]
