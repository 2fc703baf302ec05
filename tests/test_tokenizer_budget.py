"""The tokenizer's share of a --dram-budget (runtime/tokenizer_budget.py): what a one-shot run
and a chat keep, and the load's peak by how tokenizer.json writes its merges — each measured
against what the plan counts."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flashllm.runtime import tokenizer_budget as tb
from flashllm.format.manifest import read_manifest
from flashllm.runtime.budget import BudgetError, parse_budget, plan_budget
from flashllm.format.reader import open_flash
from flashllm.generation.tokenizer import Tokenizer
from flashllm.units import format_size
from test_budget import MiB, Q15, run


@pytest.fixture(scope="module")
def spm_tiny(tmp_path_factory) -> Path:
    """A tiny model whose tokenizer decodes SentencePiece-style (byte fallback, a space prefix's
    Strip), as a GGUF "llama" vocabulary is rebuilt."""
    from flashllm.convert.convert import convert_source
    from flashllm.convert.gguf_vocab import gguf_tokenizer_json
    from test_gguf_vocab_spm import spm_fields
    from tiny_sources import ArraySource, tiny_arrays, tiny_config
    fields = spm_fields(3, True)
    cfg = tiny_config(vocab_size=len(fields["tokenizer.ggml.tokens"]), eos_token_ids=(2,),
                      context_length=256)
    src = ArraySource(cfg, tiny_arrays(cfg, seed=5), tokenizer_json=gguf_tokenizer_json(fields))
    return convert_source(src, tmp_path_factory.mktemp("spm") / "m", "f32")


def test_a_one_shot_run_releases_a_sentencepiece_tokenizer(spm_tiny, monkeypatch):
    """A one-shot run of a model whose tokenizer decodes through a byte table counts only the
    table (it releases the `tokenizers` object after the prompt), and writes the tokens' text."""
    tok = read_manifest(spm_tiny)["tokenizer"]
    merges = json.loads((spm_tiny / "tokenizer.json").read_text())["model"]["merges"]
    assert tok["merges"] == "strings" and all(isinstance(m, str) for m in merges)
    r = run(spm_tiny, "--no-timings", "--stats", "--dram-budget", "150MiB", monkeypatch=monkeypatch)
    assert r.exit_code == 0, r.output
    share = re.search(r"DRAM budget 150 MiB: .*tokenizer (\d+) MiB", r.stderr)
    kept = tb.TOKENIZER_KEPT * tok["nbytes"] + tb.TOKENIZER_KEPT_FIXED
    loaded = tb.TOKENIZER_LOADED * tok["nbytes"] + tb.TOKENIZER_LOADED_FIXED
    assert share and int(share[1]) == -(-kept // MiB) < -(-loaded // MiB), r.stderr
    dense = run(spm_tiny, "--no-timings", monkeypatch=monkeypatch)
    assert r.stdout.splitlines()[0] == dense.stdout.splitlines()[0]


def test_a_chat_counts_the_tokenizer_it_keeps(tmp_path):
    """-i keeps the tokenizers object (it encodes every turn): 14x its JSON, not 1x."""
    from flashllm.runtime.plan import FlashOptions
    from conftest import plan_run
    man = json.loads(Q15.read_text())
    (tmp_path / "manifest.json").write_text(json.dumps(man))
    tok = man["tokenizer"]["nbytes"]
    once = plan_run(tmp_path, FlashOptions(parse_budget("560MiB")), 512, 40 * MiB)
    chat = plan_run(tmp_path, FlashOptions(parse_budget("560MiB"), keep_tokenizer=True), 512, 40 * MiB)
    assert once.resident["tokenizer"] == tb.TOKENIZER_KEPT * tok + tb.TOKENIZER_KEPT_FIXED
    assert chat.resident["tokenizer"] == tb.TOKENIZER_LOADED * tok + tb.TOKENIZER_LOADED_FIXED
    assert chat.total <= chat.budget and chat.cache_bytes < once.cache_bytes


def anon_rss() -> int:
    """Anonymous resident bytes of this process once garbage and free heap pages are gone."""
    import gc
    from flashllm.ffi.heap import trim_heap
    gc.collect()
    trim_heap()
    line = next(x for x in Path("/proc/self/status").read_text().splitlines()
                if x.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


@pytest.mark.realmodel
def test_a_loaded_tokenizer_stays_within_what_a_chat_budgets():
    """SmolLM2's tokenizers object, loaded and used, holds no more than TOKENIZER_LOADED x its
    JSON (+ 4 MiB): the process's anonymous resident growth from before the model is opened
    (the JSON text included), measured."""
    from conftest import _converted
    path = _converted("smollm2-135m", "q8_0", log=lambda m: None)
    before = anon_rss()
    tok = Tokenizer.from_flash(open_flash(path))
    for _ in range(20):
        tok.encode("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 20)
    grown = anon_rss() - before
    json_bytes = read_manifest(path)["tokenizer"]["nbytes"]
    assert grown <= tb.TOKENIZER_LOADED * json_bytes + tb.TOKENIZER_LOADED_FIXED


@pytest.mark.realmodel
def test_a_one_shot_tokenizer_released_for_good_stays_within_what_the_plan_counts():
    """SmolLM2's tokenizer as a one-shot run leaves it (no word cache, the prompt encoded,
    release(keep_source=False)) holds no more than TOKENIZER_KEPT x its JSON + the fixed part:
    the process's anonymous resident growth from before the model is opened, measured. It
    decodes without the JSON and refuses to encode again."""
    from conftest import _converted
    from flashllm.generation.tokenizer import ReleasedError
    path = _converted("smollm2-135m", "q8_0", log=lambda m: None)
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 20
    before = anon_rss()
    tok = Tokenizer.from_flash(open_flash(path), word_cache=False)
    ids = tok.encode(text)
    tok.release(keep_source=False)
    grown = anon_rss() - before
    json_bytes = read_manifest(path)["tokenizer"]["nbytes"]
    assert grown <= tb.TOKENIZER_KEPT * json_bytes + tb.TOKENIZER_KEPT_FIXED
    assert tok.decode(ids) == text
    with pytest.raises(ReleasedError, match="it cannot encode again"):
        tok.encode("def")


LOAD_PEAK = """
import sys
from pathlib import Path
from flashllm.generation.tokenizer import Tokenizer
def status(key):
    return int(next(x for x in open("/proc/self/status") if x.startswith(key + ":")).split()[1])
Path("/proc/self/clear_refs").write_text("5")              # VmHWM := VmRSS
before = status("VmRSS")
tok = Tokenizer.from_json(Path(sys.argv[1]).read_bytes(), word_cache=False)
print((status("VmHWM") - before) * 1024)
"""


@pytest.mark.realmodel
def test_a_compacted_tokenizer_loads_within_what_the_plan_checks(tmp_path):
    """SmolLM2's tokenizer.json with its merges compacted (as convert writes them) peaks, while
    the file is read and the `tokenizers` object and its table are built, within
    TOKENIZER_LOAD_STRINGS + 1 times its bytes (measured in a fresh process, VmHWM reset)."""
    import subprocess
    import sys
    from conftest import _converted
    from flashllm.convert.merges import compact_merges
    path = _converted("smollm2-135m", "q8_0", log=lambda m: None)
    text, form = compact_merges(open_flash(path).tokenizer_json)
    (tmp_path / "tokenizer.json").write_text(text, encoding="utf-8")
    nbytes = len(text.encode("utf-8"))
    out = subprocess.run([sys.executable, "-c", LOAD_PEAK, str(tmp_path / "tokenizer.json")],
                         capture_output=True, text=True, check=True).stdout
    peak = tb.tokenizer_load_peak({"nbytes": nbytes, "merges": form})
    assert form == "strings" and int(out) <= peak, (int(out) / nbytes, peak / nbytes)


def test_the_load_peak_counts_compact_merges_smaller(tmp_path):
    """The tokenizer's load is checked at TOKENIZER_LOAD + 1 times its JSON, or
    TOKENIZER_LOAD_STRINGS + 1 when the manifest says its merges are strings."""
    man = json.loads(Q15.read_text())
    nbytes = man["tokenizer"]["nbytes"]
    for merges, per_byte in ((None, tb.TOKENIZER_LOAD), ("pairs", tb.TOKENIZER_LOAD),
                             ("strings", tb.TOKENIZER_LOAD_STRINGS)):
        man["tokenizer"].pop("merges", None)
        man["tokenizer"].update({"merges": merges} if merges else {})
        need = 40 * MiB + (per_byte + 1) * nbytes
        with pytest.raises(BudgetError, match=f"peak at {format_size(need, 'MiB', up=True)}"):
            plan_budget(man, parse_budget(str(need - 1)), 512, 40 * MiB)
        assert plan_budget(man, parse_budget(str(need + 200 * MiB)), 512, 40 * MiB).budget


def test_only_an_older_conversion_is_told_to_convert_again():
    """A refused tokenizer load suggests converting again only where the manifest records no
    merges form (a conversion older than the field): "none" (no BPE merges), "pairs" and
    "strings" are what a conversion writes today."""
    man = json.loads(Q15.read_text())
    for merges, hinted in ((None, True), ("none", False), ("pairs", False), ("strings", False)):
        man["tokenizer"].pop("merges", None)
        man["tokenizer"].update({"merges": merges} if merges else {})
        with pytest.raises(BudgetError, match="cannot load the tokenizer") as e:
            plan_budget(man, parse_budget("60MiB"), 512, 40 * MiB)
        assert ("flashllm convert ... --force" in str(e.value)) == hinted, (merges, str(e.value))
