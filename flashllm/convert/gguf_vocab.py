"""A GGUF file's vocabulary rebuilt as a Hugging Face tokenizer.json (at convert time).

`gguf_tokenizer_json` rebuilds a byte-level BPE ("gpt2" model) vocabulary with the pre-tokenizer
regexes llama.cpp uses for `tokenizer.ggml.pre` (src/llama-vocab.cpp), and a SentencePiece ("llama"
model, e.g. Gemma) vocabulary as the BPE that llama.cpp's llm_tokenizer_spm runs: spaces become
"▁" (U+2581), an optional "▁" prefix (tokenizer.ggml.add_space_prefix), then adjacent pieces merge,
the pair whose concatenation is the highest-scoring token first (the merges, ranked by that score),
and a character no token holds falls back to its <0xXX> byte tokens. Control and user-defined
tokens are split out of the text first, as llama.cpp's special-token partition does.

The JSON is streamed (`GGUFVocab.write`), byte for byte what `tokenizers` writes for that tokenizer
with its merges in the compact "left right" form (convert/merges.py) where no piece holds a space:
only the small parts (normalizer, pre-tokenizer, decoder, ...) are built by `tokenizers`; the
vocabulary, the merges and the added tokens are written as they are read, the merges of a
SentencePiece vocabulary ranked in two int32 arrays. Its peak is a few dozen bytes per token above
the GGUF's own lists (tests/test_gguf_vocab_memory.py), not the ~1.3 kB per token of the
`tokenizers` object, its JSON text and a re-parse of it.
"""
from __future__ import annotations

import io
import json
from array import array
from typing import Callable, Mapping, Sequence

import numpy as np

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from flashllm.convert.merges import PAIRS, STRINGS
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


_CHUNK = 4096                                   # entries joined into one text before it is put
_FLUSH = 1 << 20                                # characters buffered before a write
_string = json.encoder.encode_basestring        # a str as JSON, UTF-8 as is (json.dumps' form)


def _dump(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class _Out:
    """Text put in pieces, given to write(bytes) as UTF-8 about _FLUSH characters at a time."""

    def __init__(self, write: Callable[[bytes], object]):
        self.write, self.parts, self.size = write, [], 0

    def __call__(self, text: str) -> None:
        self.parts.append(text)
        self.size += len(text)
        if self.size >= _FLUSH:
            self.flush()

    def flush(self) -> None:
        self.write("".join(self.parts).encode("utf-8"))
        self.parts, self.size = [], 0


def _put_json(value, put: Callable[[str], None]) -> None:
    """value as compact JSON (json.dumps' form); a callable in it is a streamed part that puts its
    own text."""
    if callable(value):
        value(put)
    elif isinstance(value, dict):
        put("{")
        for n, (key, v) in enumerate(value.items()):
            put(("," if n else "") + _string(key) + ":")
            _put_json(v, put)
        put("}")
    elif isinstance(value, list):
        put("[")
        for n, v in enumerate(value):
            put("," if n else "")
            _put_json(v, put)
        put("]")
    else:
        put(_dump(value))


def _items(n: int, item: Callable[[int], str], brackets: str = "[]") -> Callable:
    """A streamed JSON list (or object: brackets "{}") of the texts item(0) .. item(n - 1)."""
    def put_all(put: Callable[[str], None]) -> None:
        put(brackets[0])
        for k0 in range(0, n, _CHUNK):
            put(("," if k0 else "") + ",".join(item(k) for k in range(k0, min(n, k0 + _CHUNK))))
        put(brackets[1])
    return put_all


def _merge_text(left: str, right: str, form: str) -> str:
    return _string(f"{left} {right}") if form == STRINGS else f"[{_string(left)},{_string(right)}]"


class GGUFVocab:
    """A checked GGUF vocabulary that `write` streams as tokenizer.json, once (it then lets its
    lists go). `merges` is the form of its merges (convert/merges.py: "strings" or "pairs")."""

    def __init__(self, skeleton: dict, tokens: Sequence[str], types: Sequence[int],
                 merges: Callable, form: str):
        self.merges = form
        self._parts = (skeleton, tokens, types, merges)

    def write(self, write: Callable[[bytes], object]) -> None:
        """The tokenizer.json bytes, given to write (e.g. a binary file's) piece by piece."""
        if self._parts is None:
            raise ValueError("a GGUF vocabulary is written once")
        skeleton, tokens, types, merges = self._parts
        self._parts = None
        added = [i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]   # ids, in order
        doc = dict(skeleton, added_tokens=_items(len(added), lambda k: (
            f'{{"id":{added[k]},"content":{_string(tokens[added[k]])},"single_word":false,'
            f'"lstrip":false,"rstrip":false,"normalized":false,'
            f'"special":{"true" if types[added[k]] == CONTROL else "false"}}}')))
        doc["model"] = dict(skeleton["model"], merges=merges, vocab=_items(
            len(tokens), lambda i: f"{_string(tokens[i])}:{i}", "{}"))
        out = _Out(write)
        _put_json(doc, out)
        out.flush()

    def text(self) -> str:
        """The tokenizer.json text (once, as write)."""
        buf = io.BytesIO()
        self.write(buf.write)
        return buf.getvalue().decode("utf-8")


def gguf_tokenizer_json(fields: Mapping) -> str | None:
    """The tokenizer.json text of gguf_vocab(fields); None when the file has no vocabulary."""
    vocab = gguf_vocab(fields)
    return None if vocab is None else vocab.text()


def gguf_vocab(fields: Mapping) -> GGUFVocab | None:
    """The GGUF vocabulary in `fields` (GGUFReader.fields or key -> value), checked, to be written
    as a tokenizer.json. None when the file has no vocabulary; SourceError for a vocabulary that
    cannot be rebuilt."""
    kind = _field_value(fields, "tokenizer.ggml.model")
    if kind is None:
        return None
    if kind not in ("gpt2", "llama"):
        raise SourceError(f"GGUF tokenizer model {kind!r} is unsupported (supported: byte-level BPE "
                          "'gpt2', SentencePiece 'llama')")
    tokens = _field_value(fields, "tokenizer.ggml.tokens", [])
    if not all(tokens):
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]   # as llama.cpp does
    types = _field_value(fields, "tokenizer.ggml.token_type", None)
    types = [NORMAL] * len(tokens) if types is None else types
    known = set(tokens)
    if len(known) != len(tokens) or len(types) != len(tokens):
        raise SourceError("GGUF vocabulary has duplicate tokens or a token_type list of another length")
    if kind == "gpt2":
        tok, add_bos, merges, form = _bpe(fields, known)
    else:
        del known
        tok, add_bos, merges, form = _sentencepiece(fields, tokens, types)
    tok.post_processor = _post_processor(
        _special(tokens, fields, "tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token", add_bos),
        _special(tokens, fields, "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_eos_token", False))
    return GGUFVocab(json.loads(tok.to_str()), tokens, types, merges, form)


def bpe_steps(tok: HFTokenizer, family: str) -> None:
    """A byte-level BPE's pre-tokenizer (llama.cpp's regexes of the family) and decoder."""
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in _PRE_REGEXES[family]]
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()


def spm_steps(tok: HFTokenizer, fields: Mapping) -> None:
    """A SentencePiece vocabulary's normalizer ("▁" for spaces, an optional prefix) and decoder."""
    steps = [normalizers.Replace(" ", SPACE)]
    if _field_value(fields, "tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend(SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    decode = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if _field_value(fields, "tokenizer.ggml.add_space_prefix", True):
        decode.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decode)


def _bpe(fields: Mapping, known: set[str]) -> tuple[HFTokenizer, bool, Callable, str]:
    """A byte-level BPE ("gpt2") tokenizer without its vocabulary, its add_bos default, its
    streamed merges (checked as `tokenizers` checks them) and their form."""
    pre = _field_value(fields, "tokenizer.ggml.pre", "default")
    if pre not in _PRE_TYPES:
        raise SourceError(f"GGUF pre-tokenizer {pre!r} is unsupported (supported: {', '.join(sorted(_PRE_TYPES))})")
    family, ignore_merges, add_bos = _PRE_TYPES[pre]
    merges = _field_value(fields, "tokenizer.ggml.merges", [])
    compact = True
    for m in merges:
        left, space, right = m.partition(" ")
        if not space:
            raise SourceError("GGUF tokenizer.ggml.merges holds an entry that is not 'left right'")
        for piece in (left, right, left + right):
            if piece not in known:
                raise SourceError(f"GGUF vocabulary cannot be rebuilt (the merge {m!r} names "
                                  f"{piece!r}, which is not a token)")
        compact = compact and bool(left) and bool(right) and " " not in right
    form = STRINGS if compact else PAIRS
    tok = HFTokenizer(models.BPE(vocab={}, merges=[], ignore_merges=ignore_merges))
    bpe_steps(tok, family)

    def put_merges(put: Callable[[str], None]) -> None:      # at write, `known` let go
        order = _last_of_each(merges)
        _items(len(order), lambda k: _merge_text(*merges[order[k]].split(" ", 1), form))(put)
    return tok, add_bos, put_merges, form


def _last_of_each(merges: Sequence[str]) -> Sequence[int]:
    """The merges' indices, a merge listed twice at its last place only (as `tokenizers` ranks it)."""
    if len(set(merges)) == len(merges):
        return range(len(merges))
    return sorted({m: i for i, m in enumerate(merges)}.values())


def spm_merges(tokens: Sequence[str], types: Sequence[int],
               scores: Sequence[float]) -> tuple[np.ndarray, np.ndarray, bool]:
    """Every split of a normal token into two normal tokens, ranked as llama.cpp's SentencePiece
    tokenizer merges (the higher the merged token's score, the earlier; then by id and cut):
    (ids, cuts), each (n_merges,) int32, the merge of ids[k] being (token[:cut], token[cut:]), and
    whether a merged token holds a space."""
    normal = {t for t, kind in zip(tokens, types) if kind == NORMAL}
    ids, cuts, spaced = array("i"), array("i"), False
    for i, (piece, kind) in enumerate(zip(tokens, types)):
        if kind != NORMAL:
            continue
        for cut in range(1, len(piece)):
            if piece[:cut] in normal and piece[cut:] in normal:
                ids.append(i)
                cuts.append(cut)
                spaced = spaced or " " in piece
    del normal
    id_arr = np.array(ids, dtype=np.int32)                             # (n_merges,)
    cut_arr = np.array(cuts, dtype=np.int32)                           # (n_merges,)
    del ids, cuts
    rank = np.lexsort((cut_arr, id_arr, -np.asarray(scores, dtype=np.float64)[id_arr]))
    return id_arr[rank], cut_arr[rank], spaced


def _sentencepiece(fields: Mapping, tokens: Sequence[str],
                   types: Sequence[int]) -> tuple[HFTokenizer, bool, Callable, str]:
    """A SentencePiece ("llama") vocabulary as a BPE with byte fallback (without its vocabulary),
    its add_bos default, its streamed merges and their form."""
    scores = _field_value(fields, "tokenizer.ggml.scores", [])
    if len(scores) != len(tokens):
        raise SourceError(f"GGUF tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    unk = _field_value(fields, "tokenizer.ggml.unknown_token_id")
    if unk is not None and not 0 <= int(unk) < len(tokens):
        raise SourceError(f"GGUF tokenizer.ggml.unknown_token_id={unk} is outside the vocabulary "
                          f"of {len(tokens)} tokens")
    ids, cuts, spaced = spm_merges(tokens, types, scores)
    form = PAIRS if spaced else STRINGS
    tok = HFTokenizer(models.BPE(vocab={}, merges=[], byte_fallback=True, fuse_unk=True,
                                 unk_token=tokens[int(unk)] if unk is not None else None))
    spm_steps(tok, fields)

    def merge(k: int) -> str:
        token, cut = tokens[ids[k]], cuts[k]
        return _merge_text(token[:cut], token[cut:], form)
    return tok, True, _items(len(ids), merge), form
