"""Perplexity (llama.cpp's definition) vs the same definition computed from transformers logits,
and vs llama.cpp itself on the real SmolLM2-135M and Gemma-3-270M (fixtures from
scripts/fixtures/make_llamacpp_ppl_fixture.py)."""
from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_tiny import VOCAB

from flashllm.format.reader import open_flash
from flashllm.convert.convert import convert
from flashllm.runtime.model import Model
from flashllm.generation.perplexity import PerplexityError, bos_to_add, perplexity

FIXTURE = Path(__file__).parent / "fixtures" / "llamacpp" / "smollm2-135m.ppl.json"
TOKENS = np.random.default_rng(11).integers(3, VOCAB, size=70)     # (70,)


def reference_ppl(hf, tokens, n_ctx, n_chunks, bos_id):
    """llama.cpp's perplexity written out with torch: chunks of n_ctx, BOS replacing the first
    token, log-softmax of the second half's predictions."""
    import torch
    nll = []
    for c in range(n_chunks):
        chunk = torch.tensor(tokens[c * n_ctx:(c + 1) * n_ctx], dtype=torch.long)
        inp = chunk.clone()
        if bos_id is not None:
            inp[0] = bos_id
        with torch.no_grad():
            logp = torch.log_softmax(hf(inp[None]).logits[0].double(), dim=-1)   # (n_ctx, vocab)
        first = n_ctx // 2
        for j in range(first, n_ctx - 1):
            nll.append(-float(logp[j, chunk[j + 1]]))
    nll = np.array(nll)
    ppl = math.exp(nll.mean())
    return ppl, ppl * math.sqrt(nll.var() / (len(nll) - 1)), len(nll)


@pytest.mark.parametrize("name,bos", [("llama", None), ("qwen2", 1), ("opt", None)])
def test_perplexity_equals_transformers_definition(hf_tiny, tmp_path, name, bos):
    folder, hf = hf_tiny(name)
    convert(folder, tmp_path / "m", "f32")
    model = Model(open_flash(tmp_path / "m"), n_threads=1, n_ctx=64)
    seen = []
    got = perplexity(model, TOKENS, n_ctx=32, bos_id=bos, on_chunk=lambda i, n, p: seen.append(i))
    ppl, err, count = reference_ppl(hf, TOKENS, 32, 2, bos)
    assert (got.n_chunks, got.count, seen) == (2, count, [1, 2])        # 70 // 32 chunks, 15 each
    assert got.ppl == pytest.approx(ppl, rel=1e-4)
    assert got.ppl_err == pytest.approx(err, rel=1e-3)
    assert got.running[-1] == got.ppl
    one = perplexity(model, TOKENS, n_ctx=32, n_chunks=1, bos_id=bos)
    assert one.ppl == pytest.approx(reference_ppl(hf, TOKENS, 32, 1, bos)[0], rel=1e-4)


def test_errors(hf_tiny, tmp_path):
    folder, _ = hf_tiny("llama")
    convert(folder, tmp_path / "m", "f32")
    model = Model(open_flash(tmp_path / "m"), n_threads=1, n_ctx=64)
    with pytest.raises(PerplexityError, match="one chunk needs 32"):
        perplexity(model, TOKENS[:20], n_ctx=32)
    with pytest.raises(PerplexityError, match="exceeds"):
        perplexity(model, TOKENS, n_ctx=128)


def test_bos_to_add():
    from tokenizers import Tokenizer as HF, models, pre_tokenizers, processors
    from flashllm.generation.tokenizer import Tokenizer
    hf = HF(models.WordLevel({"<s>": 0, "a": 1, "<unk>": 2}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert bos_to_add(Tokenizer.from_json(hf.to_str()), 0) is None
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    assert bos_to_add(Tokenizer.from_json(hf.to_str()), 0) == 0
    assert bos_to_add(Tokenizer.from_json(hf.to_str()), None) is None


@pytest.mark.realmodel
def test_smollm2_perplexity_vs_llamacpp(real_model):
    """Our f32 conversion of the Q4_1 GGUF against llama.cpp on the GGUF itself, same tokens.

    Tolerance 1%: the f32 conversion holds exactly the Q4_1-dequantized weights, so the only
    difference is arithmetic — llama.cpp quantizes the activations to q8_1 inside every Q4_1
    dot product (~0.4% relative error per product, 8-bit rounding of each 32-block), which
    moves individual log-probabilities by ~1e-2 but averages out over the 508 scored tokens;
    measured: ours 20.180 vs llama.cpp 20.261 (-0.40%, mean NLL -0.004 nats)."""
    fx = json.loads(FIXTURE.read_text())
    tokens = np.array(fx["token_ids"], dtype=np.int32)                  # (n_chunks * n_ctx,)
    assert hashlib.sha256(tokens.astype("<i4").tobytes()).hexdigest() == fx["token_sha256"]
    model = real_model("smollm2-135m", "f32")
    got = perplexity(model, tokens, n_ctx=fx["n_ctx"], bos_id=fx["bos_replaced"])
    assert got.count == fx["count"]
    assert got.ppl == pytest.approx(fx["ppl"], rel=0.01)


GEMMA_FIXTURE = FIXTURE.with_name("gemma-3-270m.ppl.json")


@pytest.mark.realmodel
def test_gemma3_f32_perplexity_vs_llamacpp_f32(real_model):
    """Gemma-3-270M's Q4_K_M GGUF converted at f32 against llama.cpp on the F32 re-export of the
    same GGUF (scripts/fixtures/make_f32_gguf.py: the same weights, its KV cache in f16), same
    tokens: measured ours 22.181 vs 22.186 (-0.02%)."""
    fx = json.loads(FIXTURE.with_name("gemma-3-270m-f32.ppl.json").read_text())
    tokens = np.array(fx["token_ids"], dtype=np.int32)                  # (n_chunks * n_ctx,)
    assert hashlib.sha256(tokens.astype("<i4").tobytes()).hexdigest() == fx["token_sha256"]
    got = perplexity(real_model("gemma-3-270m", "f32"), tokens, n_ctx=fx["n_ctx"],
                     bos_id=fx["bos_replaced"])
    print(f"gemma-3-270m f32: perplexity {got.ppl:.3f} vs llama.cpp f32 {fx['ppl']:.3f}")
    assert got.count == fx["count"]
    assert got.ppl == pytest.approx(fx["ppl"], rel=0.01)


@pytest.mark.realmodel
@pytest.mark.parametrize("kind", ["code", "prose"])
def test_gemma3_native_perplexity_within_1pct_of_llamacpp(kind):
    """The conversion `flashllm run gemma-3-270m` makes (native) against llama.cpp running the
    same Q4_K_M file at its defaults, on llama.cpp's token ids: 8 chunks of 512 (2040 scored
    tokens), f16 KV as `run`. Measured ×0.9943 (code), ×1.0001 (prose).

    llama.cpp rounds the activations of every quantized dot product to 8 bits (q8_0 / q8_K),
    and on this model the realisation of that rounding is chaotic: a sub-ulp change upstream
    (llama.cpp's f16 GELU table; prefill against decode) redraws it. llama.cpp on this file
    scored token by token (its decode path) instead of in one batch gives ×0.9971 (code) and
    ×1.0039 (prose) of its own figures here, and on the F32 re-export of the file ×0.9927 and
    ×0.9978. The 508-token fixture above is too short for a 1% bar: there llama.cpp's decode
    path gives ×0.9891 of its batch figure (docs/history/2026-11-24-conversion-studies.md, Gemma-3-270M)."""
    from conftest import _converted
    fx = json.loads(FIXTURE.with_name(f"gemma-3-270m-{kind}.ppl.json").read_text())
    tokens = np.array(fx["token_ids"], dtype=np.int32)                  # (n_chunks * n_ctx,)
    assert hashlib.sha256(tokens.astype("<i4").tobytes()).hexdigest() == fx["token_sha256"]
    path = _converted("gemma-3-270m", "native", log=lambda m: print(m, file=sys.stderr))
    net = Model(open_flash(path), n_threads=1, n_ctx=fx["n_ctx"], kv_dtype="f16")
    got = perplexity(net, tokens, n_ctx=fx["n_ctx"], bos_id=fx["bos_replaced"])
    print(f"gemma-3-270m native, {kind}: perplexity {got.ppl:.4f} vs llama.cpp {fx['ppl']:.4f} "
          f"(x{got.ppl / fx['ppl']:.4f})")
    assert got.count == fx["count"] == 2040
    assert got.ppl == pytest.approx(fx["ppl"], rel=0.01)


@pytest.mark.realmodel
def test_gemma3_tokenizes_the_perplexity_text_as_llamacpp(real_model):
    """The rebuilt SentencePiece vocabulary against llama.cpp's tokenizer on ~1000 tokens of
    Python source (the perplexity fixture's text, rebuilt from this Python's stdlib)."""
    from flashllm.generation.tokenizer import Tokenizer
    from flashllm.sparsity.corpus import code_text, stdlib_dir
    fx = json.loads(GEMMA_FIXTURE.read_text())
    text = code_text("evaluation", stdlib_dir(), max_chars=40000)   # the fixture's --text-chars
    if hashlib.sha256(text.text.encode()).hexdigest() != fx["text"]["sha256"]:
        pytest.skip("this Python's stdlib gives another text than the fixture's")
    tok = Tokenizer.from_flash(real_model("gemma-3-270m", "f32").w.flash)
    ids = tok.encode(text.text)[: len(fx["token_ids"])]
    assert ids == fx["token_ids"]
