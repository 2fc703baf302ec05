"""Token id -> bytes tables: how a vocabulary whose decoder only maps each token to bytes decodes
once the `tokenizers` object is released (generation/tokenizer.py).

Two decoders get a table, told apart by their JSON (`table_decoder`, one predicate for the loaded
object and for a tokenizer.json read before anything loads: `decoder_of_file`):
    byte-level      ByteLevel (GPT-2, Qwen, SmolLM2): each character of a piece is one byte
    SentencePiece   Sequence[Replace("▁", " "), ByteFallback, Fuse] (Gemma, and the vocabularies
                    rebuilt from a GGUF "llama" model): a <0xNN> piece is the byte NN, any other
                    is its UTF-8 with "▁" as a space; optionally followed by Strip(" ", 1, 0)
                    (Llama 2, Phi-3: a space prefix), which drops one leading space from a whole
                    decode
Byte pieces that do not form valid UTF-8 decode to U+FFFD as Python's "replace" does (one per
maximal invalid sequence; `tokenizers`' ByteFallback writes one per byte).
"""
from __future__ import annotations

import json
import mmap
import os
import re
from array import array
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from flashllm.errors import FormatError
from flashllm.format.layout import MAX_TOKENIZER_BYTES

BYTE_LEVEL, SPM, SPM_STRIP = "byte-level", "sentencepiece", "sentencepiece+strip"
SPACE = "\u2581"                                         # SentencePiece's visible space
_SPM_STEPS = [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
              {"type": "ByteFallback"}, {"type": "Fuse"}]
_STRIP = {"type": "Strip", "content": " ", "start": 1, "stop": 0}
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_DECODER_KEY = re.compile(rb'"decoder"\s*:\s*')
_DECODER_WINDOW = 64 << 10     # bytes read after the key: a decoder's JSON is a few hundred


def table_decoder(decoder) -> str | None:
    """The kind of table a decoder (its JSON as a dict) decodes through: BYTE_LEVEL, SPM or
    SPM_STRIP; None for any other decoder (decoding then needs the `tokenizers` object)."""
    if not isinstance(decoder, dict):
        return None
    if decoder.get("type") == "ByteLevel":
        return BYTE_LEVEL
    steps = decoder.get("decoders") if decoder.get("type") == "Sequence" else None
    if not isinstance(steps, list) or steps[:3] != _SPM_STEPS:
        return None
    if len(steps) == 3:
        return SPM
    return SPM_STRIP if steps[3:] == [_STRIP] else None


def drops_leading_space(decoder) -> bool:
    """Whether a decoder (its JSON as a dict) drops the leading space of a sequence's first
    token: Metaspace prepending one, or a Strip from the start."""
    steps = decoder.get("decoders") if isinstance(decoder, dict) else None
    steps = steps if isinstance(steps, list) else [decoder]
    for s in (s for s in steps if isinstance(s, dict)):
        prepend = "always" if s.get("add_prefix_space", True) else "never"   # older JSON
        if s.get("type") == "Metaspace" and s.get("prepend_scheme", prepend) != "never":
            return True
        if s.get("type") == "Strip" and s.get("start", 0) > 0:
            return True
    return False


def decoder_json(hf) -> dict | None:
    """The decoder of a `tokenizers` object as its JSON (a dict), None when it has none."""
    return None if hf.decoder is None else json.loads(hf.decoder.__getstate__())


def decoder_of_file(file: Path):
    """The top-level "decoder" value of a tokenizer.json without parsing the rest (a whole parse
    peaks at ~17x the file in Python objects): the value after the first "decoder" key that is
    an object or null (a vocabulary's token "decoder" maps to a number). None when there is
    none, the file cannot be read, or the value does not parse."""
    try:
        with open(file, "rb") as f:
            if os.fstat(f.fileno()).st_size > MAX_TOKENIZER_BYTES:   # not scanned: the reader
                return None                                          # refuses the folder
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return _decoder_in(m)
    except (OSError, ValueError):
        return None


def _decoder_in(m) -> dict | None:
    """decoder_of_file's search of the file's bytes m."""
    for key in _DECODER_KEY.finditer(m):
        head = m[key.end():key.end() + _DECODER_WINDOW].decode("utf-8", "ignore")
        try:
            value = json.JSONDecoder().raw_decode(head)[0]
        except (ValueError, RecursionError):
            return None
        if value is None or isinstance(value, dict):
            return value
    return None


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable character -> byte table, the inverse of the ByteLevel pre-tokenizer's."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
          *range(ord("\u00ae"), ord("\u00ff") + 1)]
    extra = [b for b in range(256) if b not in bs]
    return {chr(b): b for b in bs} | {chr(256 + n): b for n, b in enumerate(extra)}


def _byte_level_piece(chars: dict[str, int]):
    def piece(t: str) -> bytes:
        mapped = [chars.get(c) for c in t]
        return t.encode("utf-8") if None in mapped else bytes(mapped)
    return piece


def _spm_piece(t: str) -> bytes:
    byte = _BYTE_PIECE.fullmatch(t)
    return bytes([int(byte[1], 16)]) if byte else t.replace(SPACE, " ").encode("utf-8")


class ByteTable:
    """Token id -> the bytes it decodes to: what decoding needs once the `tokenizers` object
    (tens of MiB) is gone. Special (control) tokens are flagged so they can be skipped, as
    `tokenizers` does with skip_special_tokens. strip: a whole decode drops one leading space."""

    def __init__(self, pieces: Iterable[bytes], special: Sequence[int], strip: bool = False):
        """pieces: each token's bytes in id order, taken one at a time (a list of a large
        vocabulary's would leave ~2 MiB of Python's small-object arenas resident once freed)."""
        blob, ends = bytearray(), array("q")
        for p in pieces:
            blob += p
            ends.append(len(blob))
        self.offsets = np.zeros(len(ends) + 1, dtype=np.int64)         # (vocab + 1,)
        self.offsets[1:] = ends
        self.blob = bytes(blob)
        self.special = np.zeros(len(ends), dtype=bool)                 # (vocab,)
        self.special[list(special)] = True
        self.strip = strip

    @classmethod
    def from_hf(cls, hf) -> "ByteTable | None":
        """The table of a `tokenizers` object whose decoder has one (table_decoder); None for
        any other decoder."""
        kind = table_decoder(decoder_json(hf))
        if kind is None:
            return None
        piece = _byte_level_piece(_byte_decoder()) if kind == BYTE_LEVEL else _spm_piece
        n = hf.get_vocab_size(with_added_tokens=True)
        special = [i for i, t in hf.get_added_tokens_decoder().items() if t.special]
        return cls((piece(hf.id_to_token(i) or "") for i in range(n)), special,
                   strip=kind == SPM_STRIP)

    @property
    def nbytes(self) -> int:
        return int(self.offsets.nbytes + len(self.blob) + self.special.nbytes)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def bytes_of(self, ids: Sequence[int], skip_special: bool = True) -> bytes:
        """The bytes of a token sequence, each token's as is (no leading space dropped)."""
        o, out = self.offsets, []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self):
                raise FormatError(f"token id {i} is outside the vocabulary of {len(self)}")
            if not (skip_special and self.special[i]):
                out.append(self.blob[o[i]:o[i + 1]])
        return b"".join(out)

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """The text of a whole token sequence, as the `tokenizers` object decodes it."""
        text = self.bytes_of(ids, skip_special).decode("utf-8", errors="replace")
        return text[1:] if self.strip and text.startswith(" ") else text
