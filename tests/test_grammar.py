"""Structured output (generation/grammar.py, generation/constrain.py): the token table llguidance
gets from flashllm's own tokenizer, the constrained sampler's distribution, and JSON schemas
on a real model at temperature 0.8, every answer checked by json and jsonschema (the
independent reference), never by our own matcher.

The token table is checked against the text the tokenizer encoded (its UTF-8 bytes) for the
byte-level BPE vocabularies (SmolLM2, Qwen2.5) and Gemma 3's SentencePiece one (byte-fallback
<0xNN> tokens, the U+2581 space)."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from conftest import _converted, local_gguf  # noqa: E402
from flashllm.generation.constrain import ConstrainedSampler, GrammarDraft  # noqa: E402
from flashllm.generation.generate import generate  # noqa: E402
from flashllm.generation.grammar import (GrammarError, SPECIAL_PREFIX, compile_grammar,  # noqa: E402
                                         token_env, token_pieces)
from flashllm.generation.sampler import Sampler, SamplerParams  # noqa: E402
from flashllm.generation.speculate import Guesses, NgramDraft  # noqa: E402
from flashllm.generation.tokenizer import Tokenizer  # noqa: E402
from scripts.bench.grammar import PROMPTS, SCHEMAS  # noqa: E402

TEXTS = ["Hello, world!", "  two spaces\nand a newline\ttab", "naïve café — “quotes” ±",
         "emoji 🙂 and 漢字 and Ελληνικά", '{"key": [1, 2.5e-3, null]}', "ends with space "]


def gguf_tokenizer(name: str) -> Tokenizer:
    """The tokenizer flashllm rebuilds from a real GGUF's vocabulary (as a conversion writes it)."""
    from flashllm.convert.gguf_vocab import gguf_vocab
    from flashllm.convert.sources.gguf_file import GGUFFile
    path = local_gguf(name)
    if path is None:
        pytest.skip(f"{name}.gguf is not in FLASHLLM_TEST_MODELS")
    f = GGUFFile(path)
    eos = f.fields.get("tokenizer.ggml.eos_token_id")
    return Tokenizer.from_json(gguf_vocab(f.fields).text(), [] if eos is None else [int(eos)])


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma-3-270m"])
def test_token_bytes_spell_the_encoded_text(name):
    tok = gguf_tokenizer(name)
    pieces = token_pieces(tok.table, tok.vocab_size + 3)
    assert pieces[-3:] == [b"", b"", b""]                       # past the tokenizer: never allowed
    for text in TEXTS:
        ids = tok.encode(text, add_special=False)
        assert b"".join(pieces[i] for i in ids) == text.encode("utf-8"), (name, text)
    vocab = tok.hf.get_vocab(with_added_tokens=True)
    special = [i for i, t in tok.hf.get_added_tokens_decoder().items() if t.special]
    assert special and all(pieces[i] == SPECIAL_PREFIX + tok.hf.id_to_token(i).encode()
                           for i in special)
    if name == "gemma-3-270m":                               # SentencePiece: bytes and spaces
        assert pieces[vocab["<0xE2>"]] == b"\xe2" and pieces[vocab["<0x0A>"]] == b"\n"
        assert pieces[vocab["\u2581the"]] == b" the"


def test_masked_distribution_is_the_chain_over_allowed_tokens():
    """ConstrainedSampler's candidates and probabilities are Sampler's on logits with every
    forbidden token at -inf (numpy's reference), for greedy, top-k / top-p / min-p chains."""
    tok = gguf_tokenizer("smollm2-135m")
    env = token_env(tok, tok.vocab_size)
    grammar = compile_grammar("json_schema", json.dumps(SCHEMAS["numbers"]))
    rng = np.random.default_rng(3)
    history = [1, 2, 3]
    prefix = tok.encode('{"temperature": 2', add_special=False)
    for params in (SamplerParams(temp=0), SamplerParams(temp=0.8, top_k=40),
                   SamplerParams(temp=1.3, top_k=0, top_p=0.9, min_p=0.0)):
        s = ConstrainedSampler(params, env, grammar)
        s.begin(len(history))
        mask = s.allowed(history + prefix)                       # (vocab,)
        allowed = set(np.flatnonzero(mask).tolist())
        assert allowed >= set(tok.encode("1", add_special=False)) and \
            not allowed & set(tok.encode("a", add_special=False))
        logits = rng.normal(size=tok.vocab_size).astype(np.float32) * 4    # (vocab,)
        ids, probs = s.distribution(logits, history + prefix)
        ref_ids, ref_probs = Sampler(params).distribution(np.where(mask, logits, -np.inf),
                                                           history + prefix)
        live = probs > 0
        np.testing.assert_array_equal(ids[live], ref_ids[ref_probs > 0])
        np.testing.assert_allclose(probs[live], ref_probs[ref_probs > 0], rtol=1e-6)
        assert all(mask[t] for t in ids[live])


def test_a_bad_schema_or_grammar_is_one_clear_error():
    for kind, text, says in [("json_schema", '{"type": "objec', "not valid JSON"),
                             ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}',
                              "does not compile"),
                             ("json_schema", "[1, 2]", "must be a JSON object"),
                             ("gbnf", "root ::= missing", "does not compile"),
                             ("gbnf", 'root := "a"', "does not compile")]:
        with pytest.raises(GrammarError, match=says) as e:
            compile_grammar(kind, text)
        assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M (native) in DRAM, its tokenizer, chat template and token env."""
    from flashllm.format.reader import open_flash
    from flashllm.runtime.model import Model
    from flashllm.serve.model import chat_template
    flash = open_flash(_converted("smollm2-135m", "native", log=lambda m: None))
    tok = Tokenizer.from_flash(flash)
    net = Model(flash, n_threads=1, n_ctx=512, kv_dtype="f16")
    return net, tok, chat_template(flash, tok), token_env(tok, flash.config.vocab_size)


def answer(model, kind: str, subject: str, sampler, n: int = 200, draft=None):
    net, tok, template, _ = model
    prompt = template.render([{"role": "user", "content": PROMPTS[kind].format(subject)}],
                             add_generation_prompt=True)
    out: list = []
    stats = generate(net, sampler, tok.encode(prompt, add_special=False), n,
                     stop_ids=tok.eos_ids, on_token=out.append, draft=draft)
    return tok.decode(out), stats


@pytest.mark.realmodel
@pytest.mark.parametrize("kind", list(SCHEMAS))
def test_schemas_at_temperature_validate(smollm2, kind):
    """Each schema, three seeds at temperature 0.8: the answer parses and validates, and the
    grammar's completion ended it (no -n cut at 200 tokens)."""
    schema, env = SCHEMAS[kind], smollm2[3]
    grammar = compile_grammar("json_schema", json.dumps(schema))
    for seed, subject in enumerate(["a lighthouse keeper", "a glassblower", "a kite maker"]):
        sampler = ConstrainedSampler(SamplerParams(temp=0.8, seed=seed), env, grammar)
        draft = GrammarDraft(sampler)
        text, stats = answer(smollm2, kind, subject, sampler, draft=draft)
        jsonschema.validate(json.loads(text), schema)
        assert stats.stopped and sampler.accepting() and stats.n_gen < 200, text
        if "properties" in schema:                     # keys are forced: made without a pass
            assert draft.n_forced > 0 and stats.n_accepted > 0


@pytest.mark.realmodel
def test_gbnf_grammar_constrains_the_text(smollm2):
    gbnf = 'root ::= "Answer: " ("yes" | "no") "." (" " [A-Z] [a-z]{2,8} ".")?'
    import re
    sampler = ConstrainedSampler(SamplerParams(temp=0.8, seed=1), smollm2[3],
                                 compile_grammar("gbnf", gbnf))
    text, _ = answer(smollm2, "enum", "a puppeteer", sampler)
    assert re.fullmatch(r"Answer: (yes|no)\.( [A-Z][a-z]{2,8}\.)?", text), text


@pytest.mark.realmodel
def test_drafts_the_grammar_forbids_are_never_proposed(smollm2):
    """A prompt-lookup draft over a context full of text the schema forbids: every guess a pass
    checks is one the grammar allows there (checked token by token through a fresh matcher),
    and the answer still validates."""
    net, tok, template, env = smollm2
    grammar = compile_grammar("json_schema", json.dumps(SCHEMAS["enum"]))
    sampler = ConstrainedSampler(SamplerParams(temp=0.8, seed=4), env, grammar)
    checker = ConstrainedSampler(SamplerParams(temp=0.8), env, grammar)
    seen = []

    class Watch(GrammarDraft):
        def propose(self, history, room, pos=0):
            g = super().propose(history, room, pos)
            seen.append((list(history), list(g)))
            return g

    draft = Watch(sampler, NgramDraft(6))
    text, _ = answer(smollm2, "enum", 'a story that says {"sentiment": "bad", "mood": "sad"} '
                     'again and again: {"sentiment": "bad", "mood": "sad"}', sampler, draft=draft)
    jsonschema.validate(json.loads(text), SCHEMAS["enum"])
    n0 = sampler.start
    for history, guesses in seen:
        checker.begin(n0)
        ctx = list(history)
        for g in guesses:
            assert checker.allowed(ctx)[g], (tok.decode(history[n0:]), tok.decode(guesses))
            ctx.append(g)
    forbidden = Guesses(tok.encode('{"mood"', add_special=False))
    sampler.begin(0)
    assert sampler.valid([], forbidden) == forbidden[:1]         # "{" is allowed, "mood" not
