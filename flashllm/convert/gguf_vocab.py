"""A GGUF file's vocabulary rebuilt as a Hugging Face tokenizer.json (at convert time).

`gguf_tokenizer_json` rebuilds a byte-level BPE ("gpt2" model) vocabulary with the pre-tokenizer
regexes llama.cpp uses for `tokenizer.ggml.pre` (src/llama-vocab.cpp), and a SentencePiece ("llama"
model, e.g. Gemma) vocabulary as the BPE that llama.cpp's llm_tokenizer_spm runs: spaces become
"▁" (U+2581), an optional "▁" prefix (tokenizer.ggml.add_space_prefix), then adjacent pieces merge,
the pair whose concatenation is the highest-scoring token first (the merges, ranked by that score),
and a character no token holds falls back to its <0xXX> byte tokens. Control and user-defined
tokens are split out of the text first, as llama.cpp's special-token partition does.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from flashllm.errors import SourceError

# llama.cpp's regexes (llm_tokenizer_bpe), applied in order, each splitting the previous pieces.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_PRE_REGEXES = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "llama3": (_LLAMA3,),
    "gpt2": (_GPT2,),
    "starcoder": (r"\p{N}", _GPT2),
    "qwen2": (_QWEN2,),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
}
# tokenizer.ggml.pre -> (regex family, ignore_merges, add_bos default), as in llama_vocab::load.
_PRE_TYPES = {
    **{n: ("llama3", True, True) for n in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")},
    **{n: ("llama3", False, False) for n in ("dbrx", "smaug-bpe")},
    **{n: ("gpt2", False, False) for n in ("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "exaone4")},
    **{n: ("starcoder", False, False) for n in ("starcoder", "refact", "command-r", "smollm",
                                                 "codeshell", "exaone", "minerva-7b")},
    **{n: ("qwen2", False, False) for n in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez")},
    "falcon": ("falcon", False, False),
    "default": ("default", False, False),
}
NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6
SPACE = "\u2581"       # SentencePiece's visible space


def _field_value(fields: Mapping, key: str, default=None):
    field = fields.get(key)
    if field is None:
        return default
    return field.contents() if hasattr(field, "contents") else field


def _post_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None):
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False)
    specials = [t for t in (bos, eos) if t is not None]
    pre = f"{bos[0]} " if bos else ""
    post = f" {eos[0]}" if eos else ""
    return processors.TemplateProcessing(single=f"{pre}$A{post}", pair=f"{pre}$A{post} {pre}$B:1{post}",
                                         special_tokens=specials)


def _special(tokens: Sequence[str], fields: Mapping, key: str, flag: str, default: bool):
    tid = _field_value(fields, key)
    if not _field_value(fields, flag, default) or tid is None:
        return None
    if not 0 <= int(tid) < len(tokens):
        raise SourceError(f"GGUF {key}={tid} is outside the vocabulary of {len(tokens)} tokens")
    return tokens[int(tid)], int(tid)


def gguf_tokenizer_json(fields: Mapping) -> str | None:
    """A tokenizer.json for the GGUF vocabulary in `fields` (GGUFReader.fields or key -> value).

    None when the file has no vocabulary; SourceError for a vocabulary that cannot be rebuilt."""
    kind = _field_value(fields, "tokenizer.ggml.model")
    if kind is None:
        return None
    if kind not in ("gpt2", "llama"):
        raise SourceError(f"GGUF tokenizer model {kind!r} is unsupported (supported: byte-level BPE "
                          "'gpt2', SentencePiece 'llama')")
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
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in _PRE_REGEXES[family]]
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
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
    steps = [normalizers.Replace(" ", SPACE)]
    if _field_value(fields, "tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend(SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    decode = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if _field_value(fields, "tokenizer.ggml.add_space_prefix", True):
        decode.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decode)
    return tok, True
