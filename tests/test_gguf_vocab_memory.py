"""The GGUF vocabulary rebuilt as tokenizer.json (convert/gguf_vocab.py): streamed byte for byte as
`tokenizers` writes it (tests/gguf_vocab_reference.py), in a peak that does not grow with the
vocabulary by more than ~100 bytes a token (a 262k-token Gemma 3 converts in 200 MiB)."""
from __future__ import annotations

import random
import tracemalloc

import pytest

from gguf_vocab_reference import reference_json
from flashllm.convert.gguf_vocab import CONTROL, NORMAL, USER_DEFINED, gguf_vocab
from flashllm.convert.merges import compact_merges

BYTES = [chr(c) for c in range(0x100, 0x200)]      # stand-ins for a byte-level alphabet


def bpe_fields(n: int, seed: int = 0, spaced: bool = False) -> dict:
    """A byte-level BPE vocabulary of about n tokens: 256 characters, then strings of two and
    three of the first 64 (shuffled by seed), each the merge of its head and its last character."""
    rng = random.Random(seed)
    alphabet = BYTES[:64]
    rng.shuffle(alphabet)
    tokens, merges = list(BYTES), []
    pairs = [a + b for a in alphabet for b in alphabet]
    for piece in pairs + [p + c for p in pairs for c in alphabet]:
        if len(tokens) >= n:
            break
        tokens.append(piece)
        merges.append(f"{piece[:-1]} {piece[-1]}")
    if spaced:                                     # a piece with a space: merges stay pairs
        tokens += ["x", "y z", "xy z"]
        merges.append("x y z")
    tokens += ["<|endoftext|>", "<tool>"]
    types = [NORMAL] * (len(tokens) - 2) + [CONTROL, USER_DEFINED]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.eos_token_id": len(tokens) - 2}


def spm_fields(n: int, seed: int = 0) -> dict:
    """A SentencePiece vocabulary of about n tokens (random pieces of a small alphabet)."""
    rng = random.Random(seed)
    pieces = {"".join(rng.choices("abcdefgh\u2581", k=rng.randint(2, 7))) for _ in range(n)}
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + \
        list("abcdefgh\u2581") + sorted(pieces)
    types = [2, CONTROL, CONTROL] + [6] * 256 + [NORMAL] * (len(tokens) - 259)
    scores = [0.0] * 259 + [float(-rng.randrange(100000)) for _ in range(len(tokens) - 259)]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": False}


@pytest.mark.parametrize("fields", [bpe_fields(3000), bpe_fields(3000, 1, spaced=True),
                                    spm_fields(3000)], ids=["bpe", "bpe-spaced", "spm"])
def test_the_streamed_json_is_what_tokenizers_writes(fields):
    """Byte for byte the reference (tokenizers' own JSON, merges compacted where they can be)."""
    want, form = compact_merges(reference_json(fields))
    vocab = gguf_vocab(fields)
    assert vocab.merges == form == ("pairs" if "x y z" in fields.get("tokenizer.ggml.merges", ())
                                    else "strings")
    assert vocab.text() == want


def test_a_merge_listed_twice_ranks_as_tokenizers_ranks_it():
    fields = bpe_fields(600, 2)
    fields["tokenizer.ggml.merges"] = fields["tokenizer.ggml.merges"][:50] * 2
    assert gguf_vocab(fields).text() == compact_merges(reference_json(fields))[0]


def _rebuild_peak(fields: dict) -> int:
    """tracemalloc's peak (bytes) of checking the vocabulary and writing its JSON to a sink."""
    tracemalloc.start()
    try:
        gguf_vocab(fields).write(lambda data: None)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("make", [bpe_fields, spm_fields], ids=["bpe", "spm"])
def test_the_rebuild_peak_does_not_grow_with_the_vocabulary(make):
    """8x the tokens (32k -> 256k) adds at most 100 bytes a token to the peak (the set that
    finds duplicates and checks merges, the merges' int32 ranks; measured 38 for BPE, 57 for
    SentencePiece), not the 600 - 1600 bytes a token of building the tokenizer whole, its JSON
    text and a re-parse (tests/gguf_vocab_reference.py + compact_merges, Python objects alone)."""
    small, large = make(32_000), make(256_000)
    grow = _rebuild_peak(large) - _rebuild_peak(small)
    n = len(large["tokenizer.ggml.tokens"]) - len(small["tokenizer.ggml.tokens"])
    assert grow < 100 * n, f"the peak grew by {grow / n:.0f} bytes a token"
