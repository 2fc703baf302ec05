"""A SentencePiece ("llama") GGUF vocabulary rebuilt as tokenizer.json, against llama.cpp's SPM
tokenizer written out below from src/llama-vocab.cpp (llm_tokenizer_spm_session): UTF-8
characters as symbols; repeatedly merge the adjacent pair whose concatenation is a token of the
highest score (ties: the leftmost); a final symbol that is no token becomes its <0xXX> byte
tokens. Control and user-defined tokens are split out first (tokenizer_st_partition, longest
first), spaces become U+2581. On a random vocabulary built so that merges compete.

The real Gemma 3 vocabulary is checked against llama.cpp itself in test_parity_llamacpp.py."""
from __future__ import annotations

import heapq
import random

import pytest
from tokenizers import Tokenizer

from flashllm.convert.gguf_vocab import gguf_tokenizer_json

SP = "\u2581"
NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6


def llamacpp_spm(text: str, vocab: dict[str, int], scores: list[float]) -> list[int]:
    """llm_tokenizer_spm_session::tokenize on one raw fragment (already space-escaped)."""
    sym = list(text)                                  # symbol texts; "" once merged away
    nxt = list(range(1, len(sym))) + [-1]
    prv = list(range(-1, len(sym) - 1))
    queue = []

    def bigram(left: int, right: int) -> None:
        if left == -1 or right == -1:
            return
        merged = sym[left] + sym[right]
        if merged in vocab:
            heapq.heappush(queue, (-scores[vocab[merged]], left, right, len(merged)))

    for i in range(1, len(sym)):
        bigram(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
            continue
        sym[left], sym[right] = sym[left] + sym[right], ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        bigram(prv[left], left)
        bigram(left, nxt[left])
    out, i = [], 0
    while i != -1:
        if sym[i] in vocab:
            out.append(vocab[sym[i]])
        else:
            out += [vocab[f"<0x{b:02X}>"] for b in sym[i].encode("utf-8")]
        i = nxt[i]
    return out


def llamacpp_tokenize(text: str, tokens: list[str], types: list[int], scores: list[float],
                      space_prefix: bool = False) -> list[int]:
    """BOS, then the special-token partition (longest first) and SPM on the raw pieces, each
    given a leading space when space_prefix (they all follow the start or a special token:
    llama.cpp's is_prev_special)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    specials = sorted((i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)),
                      key=lambda i: -len(tokens[i]))
    parts: list = [text]
    for sid in specials:
        out = []
        for p in parts:
            if isinstance(p, int):
                out.append(p)
                continue
            pieces = p.split(tokens[sid])
            for k, piece in enumerate(pieces):
                if piece:
                    out.append(piece)
                if k < len(pieces) - 1:
                    out.append(sid)
        parts = out
    ids = [vocab["<bos>"]]
    for p in parts:
        raw = (" " if space_prefix else "") + p if not isinstance(p, int) else p
        ids += [p] if isinstance(p, int) else llamacpp_spm(raw.replace(" ", SP), vocab, scores)
    return ids


def random_vocab(seed: int):
    """Specials, 256 byte tokens, the characters, and random multi-character pieces of them
    with random scores (so several merges compete for the same symbols)."""
    rng = random.Random(seed)
    chars = list("abcde" + SP + "é東")
    tokens = ["<unk>", "<bos>", "<eos>", "<start>", "  "]
    types = [2, CONTROL, CONTROL, CONTROL, USER_DEFINED]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    pieces = set(c for c in chars if c != "é")        # é only via its bytes
    while len(pieces) < 120:
        pieces.add("".join(rng.choice(chars[:6]) for _ in range(rng.randint(2, 5))))
    tokens += sorted(pieces)
    types += [NORMAL] * len(pieces)
    scores = [0.0] * (len(tokens) - len(pieces)) + rng.sample(range(-5000, 0), len(pieces))
    return tokens, types, [float(s) for s in scores]


def spm_fields(seed: int, space_prefix: bool) -> dict:
    """The GGUF fields of random_vocab(seed)."""
    tokens, types, scores = random_vocab(seed)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": space_prefix}


@pytest.mark.parametrize("seed, space_prefix", [(1, False), (2, False), (3, True), (4, True)])
def test_spm_vocab_tokenizes_as_llamacpp(seed, space_prefix):
    """Gemma's vocabulary has no space prefix; Llama 2 / Phi-3 style ones do."""
    tokens, types, scores = random_vocab(seed)
    tok = Tokenizer.from_str(gguf_tokenizer_json(spm_fields(seed, space_prefix)))
    rng = random.Random(seed + 100)
    alphabet = list("abcde ") + ["é", "東", "x", "<start>", "  "]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        want = llamacpp_tokenize(text, tokens, types, scores, space_prefix)
        assert tok.encode(text).ids == want, text
        if not space_prefix:
            assert tok.decode(want, skip_special_tokens=True) == text.replace("<start>", "")


# ------------------------------------------------- compact merges, the byte table's decoding

@pytest.mark.parametrize("seed, space_prefix", [(1, False), (3, True)])
def test_compact_merges_encode_as_the_pairs(seed, space_prefix):
    """The merges rewritten as "left right" strings (they half the load's peak) tokenize every
    text as the pair form that tokenizers writes."""
    import json
    from flashllm.convert.merges import compact_merges
    from gguf_vocab_reference import reference_json
    pairs = reference_json(spm_fields(seed, space_prefix))            # built whole by tokenizers
    text, form = compact_merges(pairs)
    assert gguf_tokenizer_json(spm_fields(seed, space_prefix)) == text          # streamed alike
    merges = json.loads(text)["model"]["merges"]
    assert form == "strings" and merges and all(isinstance(m, str) for m in merges)
    assert [m.split(" ") for m in merges] == json.loads(pairs)["model"]["merges"]
    assert len(text.encode()) < len(pairs.encode())
    a, b = Tokenizer.from_str(pairs), Tokenizer.from_str(text)
    rng = random.Random(seed + 200)
    alphabet = list("abcde ") + ["é", "東", "x", "<start>", "  ", "\n", "🎉"]
    for _ in range(300):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        assert b.encode(s).ids == a.encode(s).ids, s
    assert compact_merges(text) == (text, "strings")                 # already compact


def test_merges_with_a_space_stay_pairs():
    import json
    from flashllm.convert.merges import compact_merges
    doc = {"model": {"type": "BPE", "vocab": {"a": 0, " b": 1, "a b": 2}, "merges": [["a", " b"]]}}
    text = json.dumps(doc)
    assert compact_merges(text) == (text, "pairs")
    assert compact_merges('{"model": {"type": "WordLevel", "vocab": {"a": 0}}}')[1] == "none"
    assert compact_merges('{"model": {"type": "BPE", "merges": {}}}')[1] is None
    assert compact_merges("{not json") == ("{not json", None)


def random_ids(rng: random.Random, tokens: list[str], types: list[int]) -> list[int]:
    """Normal pieces, control tokens and runs of byte tokens that form valid UTF-8 characters."""
    byte_id = {int(t[3:5], 16): i for i, t in enumerate(tokens) if types[i] == BYTE}
    normal = [i for i, t in enumerate(types) if t in (NORMAL, USER_DEFINED)]
    control = [i for i, t in enumerate(types) if t == CONTROL]
    ids = []
    for _ in range(rng.randint(0, 12)):
        kind = rng.random()
        if kind < 0.5:
            ids.append(rng.choice(normal))
        elif kind < 0.7:
            ids.append(rng.choice(control))
        else:
            ch = chr(rng.choice([rng.randint(0x20, 0x7E), rng.randint(0xA0, 0x7FF),
                                 rng.randint(0x800, 0xD7FF), rng.randint(0x10000, 0x10FFFF)]))
            ids += [byte_id[b] for b in ch.encode("utf-8")]
    return ids


@pytest.mark.parametrize("seed, space_prefix", [(1, False), (2, False), (3, True), (4, True)])
def test_the_byte_table_decodes_as_tokenizers(seed, space_prefix):
    """A SentencePiece byte-fallback decoder (with a final Strip(" ", 1, 0) for a space prefix)
    decodes through a byte table, released: what `tokenizers` decodes the same ids to, special
    tokens skipped or not. A stream keeps the leading space a whole decode strips: it is the
    text after a plain piece, as `tokenizers` decodes the piece and the ids together."""
    from flashllm.generation.tokenizer import Tokenizer as FlashTokenizer
    tokens, types, _ = random_vocab(seed)
    text = gguf_tokenizer_json(spm_fields(seed, space_prefix))
    ref, tok = Tokenizer.from_str(text), FlashTokenizer.from_json(text, word_cache=False)
    assert tok.releasable and tok.table.strip == space_prefix
    tok.release(keep_source=False)
    plain = tokens.index("a")                                        # decodes to "a" alone
    rng = random.Random(seed + 300)
    stripped = 0
    for _ in range(400):
        ids = random_ids(rng, tokens, types)
        for skip in (True, False):
            assert tok.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), ids
        det = tok.detokenizer()
        streamed = "".join([det.push(i) for i in ids] + [det.flush()])
        assert streamed == ref.decode([plain] + ids)[1:], ids
        stripped += streamed != tok.decode(ids)
    assert stripped > 20 if space_prefix else stripped == 0
