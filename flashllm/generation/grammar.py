"""Structured output's grammars, compiled by llguidance (PyPI `llguidance`): a JSON schema or a
GBNF grammar (as llama.cpp takes it) becomes llguidance's grammar text, checked before a model
loads; the model's token byte strings (generation/byte_table.py) become its token table.

    text = compile_grammar("json_schema", '{"type": "object"}')     GrammarError when it does not
    env = token_env(tokenizer, n_vocab)                              once per model (~1 s)
    matcher(env, text)                                               one per stream or answer

JSON schemas compile with bounded whitespace (JSON_WHITESPACE, as llama.cpp's converter bounds
it: a space, or a newline and up to 20 spaces or tabs), so a model cannot pad an answer with
blank lines until -n runs out.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass

from flashllm.errors import FlashError
from flashllm.ffi.heap import trim_heap

KINDS = ("json_schema", "gbnf", "lark")
JSON_WHITESPACE = r"( |\n[ \t]{0,20})?"
LEAN_BYTES, FULL_BYTES = 168, 392   # a token table's bytes a token (table_bytes)
SPECIAL_PREFIX = b"\xff"      # llguidance marks a special (control) token's bytes with it
MISSING = ("structured output (--json-schema, --grammar-file, response_format) needs the "
           "llguidance package: pip install 'flashllm[grammar]'")


class GrammarError(FlashError):
    """A schema or grammar that does not compile, or a model it cannot constrain."""


def installed() -> bool:
    """Whether llguidance can be imported (a server sets its token table aside only then)."""
    return importlib.util.find_spec("llguidance") is not None


def llguidance():
    """The llguidance module; GrammarError (one line) when it is not installed."""
    try:
        import llguidance as llg
    except ImportError:
        raise GrammarError(MISSING) from None
    return llg


def one_line(message: str) -> str:
    """An llguidance message as one line (its errors may span several)."""
    return " ".join(str(message).split())


def compile_grammar(kind: str, text: str) -> str:
    """llguidance's grammar text of a JSON schema (kind "json_schema": its JSON text), a GBNF
    grammar ("gbnf") or llguidance's Lark syntax ("lark": serve's tool calls), checked:
    GrammarError naming what does not compile."""
    llg = llguidance()
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("the JSON schema must be a JSON object (or true / false)")
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_pattern": JSON_WHITESPACE})
        except ValueError as e:
            raise GrammarError(f"the JSON schema does not compile: {one_line(e)}") from None
    elif kind in ("gbnf", "lark"):
        try:
            grammar = llg.grammar_from(kind, text)
        except ValueError as e:
            raise GrammarError(f"the grammar does not compile: {one_line(e)}") from None
    else:
        raise GrammarError(f"unknown grammar kind {kind!r} (one of {', '.join(KINDS)})")
    failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        what = "JSON schema" if kind == "json_schema" else "grammar"
        raise GrammarError(f"the {what} does not compile: {one_line(messages[0])}")
    return grammar


@dataclass(frozen=True)
class TokenEnv:
    """A model's token table for llguidance (its LLTokenizer) and the vocabulary size its masks
    cover (the logits' length, which may exceed the tokenizer's)."""

    lltok: object
    n_vocab: int


def token_pieces(table, n_vocab: int) -> list[bytes]:
    """Each token id's bytes (n_vocab of them; ids past the table: b"", which llguidance never
    allows), a special token's behind SPECIAL_PREFIX. table: a generation.byte_table.ByteTable."""
    pieces = []
    for i in range(n_vocab):
        if i >= len(table):
            pieces.append(b"")
        elif table.special[i]:
            pieces.append(SPECIAL_PREFIX + table.bytes_of([i], skip_special=False))
        else:
            pieces.append(table.bytes_of([i]))
    return pieces


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: every token's bytes, the end and start ids, the
    special ids, and an encoder of bytes. The encoder is llguidance's own greedy one (the longest
    token at each place, once the LLTokenizer exists), so a run never needs the `tokenizers`
    object again (a one-shot run releases it): llguidance encodes only the bytes a grammar
    forces, and those tokens are drafts a pass verifies (generation/constrain.GrammarDraft), so
    any tokenization of them keeps the distribution."""

    def __init__(self, pieces: list, eos: int, bos):
        self.tokens, self.eos_token_id, self.bos_token_id = pieces, eos, bos
        self.special_token_ids = [i for i, p in enumerate(pieces) if p.startswith(SPECIAL_PREFIX)]
        self.lltok = None

    def __call__(self, data) -> list[int]:
        if self.lltok is None:              # llguidance's probe while it builds the table
            return []
        data = data if isinstance(data, bytes) else data.encode("utf-8")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:     # a character cut at the end: its whole start
            text = data[:e.start].decode("utf-8")
        return self.lltok.greedy_tokenize(text)


def table_bytes(n_vocab: int, lean: bool) -> int:
    """The memory a TokenEnv of n_vocab tokens adds to a process, as measured on
    Qwen2.5-Coder's 151,936 (RSS after token_env, the `tokenizers` object released): 24 MiB
    lean, 56 MiB with llguidance's slices; what a budget's plan sets aside for a grammar."""
    return n_vocab * (LEAN_BYTES if lean else FULL_BYTES)


def token_env(tokenizer, n_vocab: int, bos=None, lean: bool = False) -> TokenEnv:
    """The TokenEnv of a generation.tokenizer.Tokenizer over n_vocab logits: its byte table's
    tokens, its end-of-sequence ids as the grammar's end. lean: without llguidance's slices (its
    per-class token tries: ~40 MiB more for a 152k vocabulary, masks ~3x faster), for a run
    under a DRAM budget. GrammarError for a tokenizer without a byte table or an end token."""
    llg = llguidance()
    if tokenizer.table is None:
        raise GrammarError("this model's tokenizer has no token -> bytes table (a byte-level or "
                           "SentencePiece byte-fallback vocabulary): its output cannot be "
                           "constrained")
    eos = [i for i in tokenizer.eos_ids if i < n_vocab]
    if not eos:
        raise GrammarError("this model names no end-of-sequence token: a constrained answer "
                           "could not end")
    vocab = _Vocabulary(token_pieces(tokenizer.table, n_vocab), eos[0], bos)
    lltok = llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=n_vocab, eos_token=eos,
                            slices=[] if lean else None)
    vocab.tokens, vocab.lltok = None, lltok          # the table lives in llguidance now
    trim_heap()
    return TokenEnv(lltok, n_vocab)


def matcher(env: TokenEnv, grammar: str):
    """A fresh llguidance LLMatcher of a compiled grammar over env; GrammarError when the grammar
    does not build over this vocabulary."""
    llg = llguidance()
    m = llg.LLMatcher(env.lltok, grammar, log_level=0)
    if m.is_error():
        raise GrammarError(f"the grammar does not compile: {one_line(m.get_error())}")
    return m
