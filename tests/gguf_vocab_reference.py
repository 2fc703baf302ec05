"""The reference for convert/gguf_vocab.py's streamed tokenizer.json: the same tokenizer built
whole by `tokenizers` (its BPE model given every token and merge) and written by its to_str(),
the merges as [left, right] pairs (compact_merges then rewrites them as strings)."""
from __future__ import annotations

from typing import Mapping

from tokenizers import AddedToken, models
from tokenizers import Tokenizer as HFTokenizer

from flashllm.convert.gguf_vocab import (_PRE_TYPES, CONTROL, NORMAL, USER_DEFINED, _field_value,
                                         _post_processor, _special, bpe_steps, spm_steps)
from flashllm.errors import SourceError


def reference_json(fields: Mapping) -> str | None:
    """A tokenizer.json for the GGUF vocabulary in `fields` (GGUFReader.fields or key -> value).

    None when the file has no vocabulary; SourceError for a vocabulary that cannot be rebuilt."""
    kind = _field_value(fields, "tokenizer.ggml.model")
    if kind is None:              # (an unsupported kind: gguf_vocab's tests)
        return None
    tokens = list(_field_value(fields, "tokenizer.ggml.tokens", []))
    types = list(_field_value(fields, "tokenizer.ggml.token_type", [NORMAL] * len(tokens)))
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]   # as llama.cpp does
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens) or len(types) != len(tokens):
        raise SourceError("GGUF vocabulary has duplicate tokens or a token_type list of another length")
    tok, add_bos = (_bpe(fields, tokens, vocab) if kind == "gpt2" else
                    _sentencepiece(fields, tokens, types, vocab))
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in range(len(tokens)) if types[i] == CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i in range(len(tokens)) if types[i] == USER_DEFINED])
    tok.post_processor = _post_processor(
        _special(tokens, fields, "tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token", add_bos),
        _special(tokens, fields, "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_eos_token", False))
    return tok.to_str()


def _bpe(fields: Mapping, tokens: list[str], vocab: dict[str, int]) -> tuple[HFTokenizer, bool]:
    """A byte-level BPE ("gpt2") tokenizer and its add_bos default."""
    pre = _field_value(fields, "tokenizer.ggml.pre", "default")
    if pre not in _PRE_TYPES:
        raise SourceError(f"GGUF pre-tokenizer {pre!r} is unsupported (supported: {', '.join(sorted(_PRE_TYPES))})")
    family, ignore_merges, add_bos = _PRE_TYPES[pre]
    merges = [tuple(m.split(" ", 1)) for m in _field_value(fields, "tokenizer.ggml.merges", [])]
    if any(len(m) != 2 for m in merges):
        raise SourceError("GGUF tokenizer.ggml.merges holds an entry that is not 'left right'")
    try:
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    except Exception as e:     # tokenizers raises plain Exception, e.g. a merge of unknown tokens
        raise SourceError(f"GGUF vocabulary cannot be rebuilt ({e})") from None
    bpe_steps(tok, family)
    return tok, add_bos


def spm_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """Every (left, right) pair of normal tokens whose concatenation is a normal token, ranked as
    llama.cpp's SentencePiece tokenizer merges: the higher the merged token's score, the earlier."""
    normal = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    found = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            if piece[:cut] in normal and piece[cut:] in normal:
                found.append((-scores[i], i, cut))
    found.sort()
    return [(tokens[i][:cut], tokens[i][cut:]) for _, i, cut in found]


def _sentencepiece(fields: Mapping, tokens: list[str], types: list[int],
                   vocab: dict[str, int]) -> tuple[HFTokenizer, bool]:
    """A SentencePiece ("llama") vocabulary as a BPE with byte fallback, and its add_bos default."""
    scores = list(_field_value(fields, "tokenizer.ggml.scores", []))
    if len(scores) != len(tokens):
        raise SourceError(f"GGUF tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    unk = _field_value(fields, "tokenizer.ggml.unknown_token_id")
    try:
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=spm_merges(tokens, types, scores),
                                     unk_token=tokens[int(unk)] if unk is not None else None,
                                     byte_fallback=True, fuse_unk=True))
    except Exception as e:
        raise SourceError(f"GGUF vocabulary cannot be rebuilt ({e})") from None
    spm_steps(tok, fields)
    return tok, True
