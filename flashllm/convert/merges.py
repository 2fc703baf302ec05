"""A BPE tokenizer.json's merges in the compact string form ("left right"), which `tokenizers`
loads in about half the peak memory of the pair form ([left, right]) that tokenizers 0.20 and
later write (docs/MEASUREMENTS.md, "Tokenizer memory"). Applied at conversion to every source's
tokenizer JSON; the form is recorded in the manifest (format/writer.py) for the budget. A GGUF's
vocabulary (convert/gguf_vocab.py) is written in the compact form from the start."""
from __future__ import annotations

import json

from flashllm.limits import loads_json
from flashllm.format.layout import MERGES_FORMS

STRINGS, PAIRS, NONE = MERGES_FORMS


def compact_merges(tokenizer_json):
    """A streamed tokenizer (a GGUFVocab: not a str) as it is, with its `merges` form. A JSON
    text: (the text with its BPE merges written as "left right" strings, "strings") when no merge
    piece holds a space, the string form's separator, or is empty (compact JSON: no indent,
    UTF-8 as is); else the text unchanged with its form: "strings" when it already has them,
    "pairs" when a piece holds a space or is empty, "none" for a model without a merges list
    (WordLevel, Unigram, ...), None for a JSON that does not load or whose merges are neither."""
    if not isinstance(tokenizer_json, str):
        return tokenizer_json, tokenizer_json.merges
    try:
        data = loads_json(tokenizer_json)
        model = data["model"]
    except (ValueError, KeyError, TypeError):
        return tokenizer_json, None
    if not isinstance(model, dict):
        return tokenizer_json, None
    merges = model.get("merges")
    if merges is None:
        return tokenizer_json, NONE
    if not isinstance(merges, list):
        return tokenizer_json, None
    if all(isinstance(m, str) for m in merges):
        return tokenizer_json, STRINGS
    if not all(isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) for p in m)
               for m in merges):
        return tokenizer_json, None
    if any(" " in p or not p for m in merges for p in m):
        return tokenizer_json, PAIRS
    data["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")), STRINGS
