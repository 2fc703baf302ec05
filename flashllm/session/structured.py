"""Structured output assembled from options: `run`'s --json-schema / --json-schema-file /
--grammar-file (and `serve`'s response_format, serve/api.py) compiled before the model loads,
then a stream's sampler constrained by it over the model's tokens (generation/constrain.py).

    fmt = output_format(schema, schema_file, grammar_file)     None: unconstrained
    grammar = fmt.compile()                                     GrammarError: one line, exit 1
    ... assemble the run ...
    env = token_env_of(parts)                                   once per model
    sampler = constrained(sampling.params(), env, grammar)
    draft = grammar_draft(sampler, draft)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from flashllm.errors import FlashError

CUT_NOTE = "note: output cut by -n before the grammar completed (raise -n)"


@dataclass(frozen=True)
class OutputFormat:
    """What the output must match: a JSON schema's text (kind "json_schema") or a GBNF grammar
    ("gbnf")."""

    kind: str
    text: str

    def compile(self) -> str:
        """llguidance's grammar text; GrammarError (a FlashError) when it does not compile."""
        from flashllm.generation.grammar import compile_grammar
        return compile_grammar(self.kind, self.text)


def output_format(schema: Optional[str], schema_file: Optional[Path],
                  grammar_file: Optional[Path]) -> Optional[OutputFormat]:
    """The OutputFormat of -j/--json-schema TEXT, --json-schema-file FILE or --grammar-file FILE
    (at most one); None when none is given. FlashError when more than one is, or a file cannot
    be read."""
    given = [g for g in (schema, schema_file, grammar_file) if g is not None]
    if len(given) > 1:
        raise FlashError("give one of -j/--json-schema, --json-schema-file and --grammar-file")
    if schema is not None:
        return OutputFormat("json_schema", schema)
    if schema_file is not None:
        return OutputFormat("json_schema", _read(schema_file, "JSON schema"))
    if grammar_file is not None:
        return OutputFormat("gbnf", _read(grammar_file, "grammar"))
    return None


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise FlashError(f"cannot read the {what} file {path}: "
                         f"{getattr(e, 'strerror', None) or e}") from None


def token_env_of(tok, flash, lean: bool = False):
    """The model's token table for grammars (generation/grammar.TokenEnv) over its logits; lean
    (a run under a DRAM budget): without llguidance's slices, in a tenth of the memory."""
    from flashllm.generation.grammar import token_env
    return token_env(tok, flash.config.vocab_size, flash.config.bos_token_id, lean)


def constrained(params, env, grammar: str):
    """A sampler of params over the tokens the compiled grammar allows."""
    from flashllm.generation.constrain import ConstrainedSampler
    return ConstrainedSampler(params, env, grammar)


def grammar_draft(sampler, draft):
    """The drafting of a constrained stream: the grammar's forced tokens, else draft's guesses
    (None: none) that the grammar allows."""
    from flashllm.generation.constrain import GrammarDraft
    return GrammarDraft(sampler, draft)
