"""The architecture registry (flashllm/model/archs/) is the only list of architectures.

No module outside model/archs/ may name an architecture (its ModelConfig.arch, a Hugging Face
class, a GGUF name), a Hugging Face tensor name of any table, or a canonical tensor only some
models hold (QK-norm, sandwich norms, biases, learned positions, projections, routers: what
model/archs/tensors.py gives a `when`). The forbidden words come from the registry itself, so a
new architecture extends the check. Read from the source with ast (string constants that are
not docstrings), nothing of the scanned modules imported."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from flashllm.errors import FormatError, SourceError
from flashllm.model.archs import REGISTRY, arch_for_gguf, arch_for_hf, arch_named
from flashllm.model.archs.base import register
from flashllm.model.archs.tensors import LAYER, MODEL, expected_tensors, required_tensors

PACKAGE = Path(__file__).resolve().parent.parent / "flashllm"
ARCHS_DIR = "model/archs"
# (file, word): names that are not architectures though they spell like one
ALLOWED = {
    # llama.cpp's tokenizer kinds (tokenizer.ggml.model "llama" = SentencePiece) and pre-tokenizer
    # names (tokenizer.ggml.pre "qwen2"): a vocabulary's, not an architecture's
    ("convert/gguf_vocab.py", "llama"), ("convert/gguf_vocab.py", "qwen2"),
}
# canonical tensors every model holds (their names are the format's, read anywhere), and the
# FFN file's tensors (layout.ffn_weight groups them by name for ffn.bin)
_FFN = {t.name for t in LAYER if t.ffn}
# the runtime's fields (Layer.q_norm, DenseWeights.proj_in): slots, named as a string by ffi/block.py's
# messages and weights.py's loop, not tensor names
FIELDS = {t.field for t in MODEL + LAYER if t.field}
_HF_GENERIC = {"weight", "bias", "model", "layers", "norm", "gate", "mlp", "experts", "decoder",
               "{i}", "{e}", "{wb}", "{m}"}


def forbidden() -> dict[str, set[str]]:
    """kind -> the words no module outside model/archs/ may hold in a string."""
    archs = REGISTRY.values()
    universal = {t.name.split(".")[0] for t in MODEL + LAYER
                 if t.when.__name__ == "_always" or t.name in _FFN}
    partial = {t.name for t in MODEL + LAYER if t.when.__name__ != "_always" and t.name not in _FFN
               and t.name != "output.weight"}          # the untied head: which head, not which arch
    stems = {n.split(".")[0] for n in partial} - universal
    hf = {seg for a in archs for pattern, _ in a.table for seg in pattern.split(".")}
    return {"arch": {a.name for a in archs} | {g for a in archs for g in a.gguf_archs},
            "hf class": {c for a in archs for c in a.hf_classes},
            "hf tensor": {s for s in hf if s not in _HF_GENERIC and "{" not in s},
            "tensor": partial | stems | {f for a in archs for f, _ in a.fused}}


def strings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every string constant that is not a docstring."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def violations(package: Path, words: dict[str, set[str]]) -> list[str]:
    """'file:line: kind word in "text"' for each forbidden word outside model/archs/."""
    found = []
    for f in sorted(package.rglob("*.py")):
        rel = f.relative_to(package).as_posix()
        if rel.startswith(ARCHS_DIR + "/"):
            continue
        for line, text in strings(ast.parse(f.read_text())):
            if text in FIELDS:
                continue
            for kind, names in words.items():
                for w in names:
                    exact = kind == "arch"
                    hit = text == w if exact else \
                        re.search(rf"(?<![\w]){re.escape(w)}(?![\w])", text)
                    if hit and (rel, w) not in ALLOWED:
                        found.append(f"{rel}:{line}: {kind} {w!r} in {text[:60]!r}")
    return found


def test_no_module_outside_the_registry_names_an_architecture():
    bad = violations(PACKAGE, forbidden())
    assert not bad, "\n".join(bad)


def test_the_check_sees_what_it_forbids(tmp_path):
    """Each kind of word is caught in a module outside model/archs/, a docstring is not."""
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "x.py").write_text(
        '"""gemma3 and q_proj in a docstring are prose."""\n'
        'A = "gemma3"\nB = f"blk.{i}.attn_q_norm.weight"\nC = ("Phi3ForCausalLM",)\n'
        'D = "model.layers.0.self_attn.q_proj.weight"\n')
    bad = violations(tmp_path, forbidden())
    found = {b.split(": ")[1].split(" in ")[0] for b in bad}
    assert {int(b.split(":")[1]) for b in bad} == {2, 3, 4, 5}           # not line 1's docstring
    assert {"arch 'gemma3'", "tensor 'attn_q_norm'", "hf class 'Phi3ForCausalLM'",
            "hf tensor 'q_proj'"} <= found


def test_lookups_by_every_name():
    for a in REGISTRY.values():
        assert arch_named(a.name) is a
        assert all(arch_for_hf({"architectures": [c]}) is a for c in a.hf_classes)
        assert all(arch_for_gguf(g) is a for g in a.gguf_archs)
    with pytest.raises(FormatError, match="unsupported architecture 'mamba'"):
        arch_named("mamba")
    with pytest.raises(SourceError, match="unsupported architecture MambaForCausalLM"):
        arch_for_hf({"architectures": ["MambaForCausalLM"]})


def test_a_table_naming_no_canonical_tensor_or_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="names no canonical tensor"):
        register("x", ["XForCausalLM"], [("model.foo.weight", "blk.{i}.attn_foo.weight")])(dict)
    with pytest.raises(ValueError, match="already registered"):
        register("x", ["LlamaForCausalLM"], [("lm_head.weight", "output.weight")])(dict)
    assert "x" not in REGISTRY


def test_required_tensors_are_the_expected_dense_ones():
    """layout's shapes and the converter's names come from one table: the dense names agree."""
    from tiny_sources import tiny_config
    for glu in (True, False):
        cfg = tiny_config(glu=glu)
        dense = [n for n in expected_tensors(cfg) if not re.search(r"ffn_(gate|up|down)\.weight", n)]
        assert list(required_tensors(cfg)) == dense
