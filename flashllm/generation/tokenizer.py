"""Text <-> token ids through the Hugging Face `tokenizers` runtime.

A model folder's tokenizer.json (an HF checkpoint's own, or one rebuilt from a GGUF vocabulary by
flashllm.convert.gguf_vocab) is used as is. Decoding of byte-level and SentencePiece
byte-fallback vocabularies goes through a token -> bytes table (generation/byte_table.py), so
the `tokenizers` object can be released after encoding.
"""
from __future__ import annotations

import codecs
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE, Unigram

from flashllm.errors import FlashError, FormatError
from flashllm.ffi.heap import trim_heap
from flashllm.format.reader import FlashModel
from flashllm.generation.byte_table import (ByteTable, decoder_json, decoder_of_file,
                                            drops_leading_space, table_decoder)

__all__ = ["ByteTable", "Detokenizer", "ReleasedError", "Tokenizer", "decodes_through_table"]
STREAM_CONTEXT = "a"    # the text a window-decoded stream may start after (Detokenizer)

WORD_CACHES = (BPE, Unigram)   # the `tokenizers` models that keep a word cache (_resize_cache)


class Detokenizer:
    """Streams text token by token without ever emitting half a UTF-8 character.

    A stream continues the text before it (a completion its prompt, an answer its chat
    template), so a leading space that a whole-sequence decode drops (SentencePiece's Strip,
    Metaspace) is kept, as llama.cpp's token_to_piece keeps it. With a byte table, token bytes
    go through an incremental UTF-8 decoder. Otherwise text is decoded over a short window (the
    previous token plus the pending ones), so decoders that depend on context (leading spaces,
    byte pieces) give the same text as a full decode; one that drops the first token's leading
    space starts after the tokens of STREAM_CONTEXT instead of at a sequence's start."""

    def __init__(self, tokenizer: "Tokenizer"):
        self._tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        after = tokenizer.table is None and drops_leading_space(decoder_json(tokenizer.hf))
        self._context = tokenizer.encode(STREAM_CONTEXT, add_special=False) if after else []
        self._start()

    def _start(self) -> None:
        self._ids: list[int] = list(self._context)
        self._prefix = 0                # start of the context window
        self._read = len(self._ids)     # ids before this index have been emitted

    def push(self, token_id: int) -> str:
        """The text that token_id completes ("" while a character is still incomplete)."""
        if self._tok.table is not None:
            return self._utf8.decode(self._tok.table.bytes_of([token_id]))
        self._ids.append(int(token_id))
        seen = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        if len(text) <= len(seen) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(seen):]

    def flush(self) -> str:
        """Whatever is still pending, complete or not; the detokenizer is then empty."""
        if self._tok.table is not None:
            return self._utf8.decode(b"", final=True)
        seen = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        self._start()
        return text[len(seen):]


def decodes_through_table(file: Path) -> bool:
    """True when a tokenizer.json's decoder has a token -> bytes table (byte_table.py): a
    one-shot run then releases the `tokenizers` object (Tokenizer.releasable). Reads only the
    file's "decoder" value; False when it cannot be read."""
    return table_decoder(decoder_of_file(file)) is not None


class ReleasedError(FlashError):
    """An encode after release(keep_source=False), which dropped what encoding needs."""


class Tokenizer:
    """Encoding through a `tokenizers` object, decoding through a token -> bytes table.

    The `tokenizers` object of a large vocabulary holds tens of MiB (more while it loads);
    `release()` drops it once the prompt is encoded, and the next encode loads it again from the
    JSON (UTF-8 bytes), which `release(keep_source=False)` drops too when nothing will be
    encoded again (a one-shot run). Decoding never needs either when there is a byte table.
    word_cache=False turns off the BPE model's cache of encoded words: what it held stays
    resident after release, and a text encoded once gains nothing from it. Sizes:
    docs/MEASUREMENTS.md, "Tokenizer memory"."""

    def __init__(self, source: str | bytes, eos_ids: Sequence[int] = (), word_cache: bool = True):
        # the JSON as UTF-8 bytes: a str of a vocabulary beyond U+FFFF takes 4 bytes a character
        self._source: bytes | None = source.encode("utf-8") if isinstance(source, str) else source
        self._hf: HFTokenizer | None = None
        self._word_cache = word_cache
        self.eos_ids: tuple[int, ...] = tuple(int(i) for i in eos_ids)
        self.table = ByteTable.from_hf(self.hf)
        self._vocab_size = self.hf.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_json(cls, source: str | bytes, eos_ids: Sequence[int] = (),
                  word_cache: bool = True) -> "Tokenizer":
        """From a tokenizer JSON, as text or UTF-8 bytes."""
        return cls(source, eos_ids, word_cache)

    @classmethod
    def from_flash(cls, flash: FlashModel, word_cache: bool = True) -> "Tokenizer":
        """From a converted model (its tokenizer.json and end-of-sequence ids)."""
        source = flash.tokenizer_bytes
        if source is None:
            raise FormatError("model has no tokenizer")
        return cls.from_json(source, flash.config.eos_token_ids, word_cache)

    @property
    def hf(self) -> HFTokenizer:
        """The `tokenizers` object, loaded from the JSON when it is not resident."""
        if self._hf is None:
            if self._source is None:
                raise ReleasedError("the tokenizer was released after the prompt was encoded "
                                    "(a one-shot run keeps only its decoding table): it cannot "
                                    "encode again")
            try:
                self._hf = HFTokenizer.from_buffer(self._source)
            except Exception as e:     # tokenizers raises plain Exception for a bad JSON
                raise FormatError(f"tokenizer JSON cannot be loaded ({e})") from None
            if not self._word_cache and isinstance(self._hf.model, WORD_CACHES):
                self._hf.model._resize_cache(0)     # the models that keep a word cache
            trim_heap()               # the load's temporaries: most of its peak
        return self._hf

    @property
    def releasable(self) -> bool:
        """True when decoding needs no `tokenizers` object (a vocabulary with a byte table):
        release() then drops it."""
        return self.table is not None

    @property
    def resident(self) -> bool:
        """True while the `tokenizers` object is loaded."""
        return self._hf is not None

    def release(self, keep_source: bool = True) -> None:
        """Drop the `tokenizers` object when decoding does not need it (a byte table exists).
        keep_source=False also drops the JSON bytes it loads from: a later encode then raises
        ReleasedError instead of loading the object again."""
        if not self.releasable:
            return
        self._hf = None
        if not keep_source:
            self._source = None
        trim_heap()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids; special tokens written in the text (e.g. <|im_start|>) become their ids."""
        return self.hf.encode(text, add_special_tokens=add_special).ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """The text of a whole sequence (to stream a continuation: detokenizer())."""
        if self.table is not None:
            return self.table.decode(ids, skip_special)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special)

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self)
