"""The tokenizer's share of a --dram-budget (runtime/budget.py), from its manifest entry: ratios
to the size of tokenizer.json, measured in docs/MEASUREMENTS.md, "Tokenizer memory".

    one-shot    after release(keep_source=False): the id -> bytes table and the heap the
                `tokenizers` object leaves (no JSON, no word cache): TOKENIZER_KEPT x the
                JSON + TOKENIZER_KEPT_FIXED. A tokenizer without a byte table is never released:
                the run counts it loaded (keep_tokenizer)
    chat        the `tokenizers` object and its JSON bytes stay loaded (it encodes every turn):
                TOKENIZER_LOADED x the JSON + TOKENIZER_LOADED_FIXED
    the load    before the model, the object peaks higher while it loads, the JSON bytes
                included: checked on its own (budget.py). The peak depends on how the JSON
                writes its BPE merges (the manifest's tokenizer "merges"): as "left right"
                strings, TOKENIZER_LOAD_STRINGS; as pairs, without BPE merges ("none"), or
                unrecorded (an older conversion), TOKENIZER_LOAD
"""
from __future__ import annotations

from flashllm.units import MiB

TOKENIZER_KEPT = 1             # resident bytes of a one-shot run's released tokenizer per byte
TOKENIZER_KEPT_FIXED = 2 * MiB  # of tokenizer.json, + these
TOKENIZER_LOAD = 26            # peak bytes while the tokenizers object loads, per JSON byte
TOKENIZER_LOAD_STRINGS = 15    # the same for merges written as "left right" strings
TOKENIZER_LOADED = 11          # resident bytes of a loaded (heap-trimmed) tokenizer per JSON byte,
TOKENIZER_LOADED_FIXED = 4 * MiB  # + these


def tokenizer_resident(entry: dict, keep: bool) -> int:
    """Bytes the tokenizer of a manifest entry holds while the model runs: loaded (keep: a chat,
    or a tokenizer without a byte table) or released after the prompt."""
    nbytes = int(entry.get("nbytes") or 0)
    per_byte, fixed = (TOKENIZER_LOADED, TOKENIZER_LOADED_FIXED) if keep \
        else (TOKENIZER_KEPT, TOKENIZER_KEPT_FIXED)
    return per_byte * nbytes + (fixed if nbytes else 0)


def older_conversion(entry: dict) -> bool:
    """True for a tokenizer converted before the manifest recorded its merges' form: converting
    its source again may write them as strings, which load at ~60% of the pairs' peak."""
    return bool(entry.get("nbytes")) and "merges" not in entry


def tokenizer_load_peak(entry: dict) -> int:
    """Peak bytes over the process while the tokenizer of a manifest entry loads: the JSON bytes
    and the `tokenizers` object being built."""
    per_byte = TOKENIZER_LOAD_STRINGS if entry.get("merges") == "strings" else TOKENIZER_LOAD
    return (per_byte + 1) * int(entry.get("nbytes") or 0)
