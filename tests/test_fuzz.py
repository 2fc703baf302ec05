"""Fuzzing every reader with truncated, bit-flipped and hostile files: each case either loads or
raises one FlashError; any other exception, or a case running past its time limit, fails.

Normal runs try a small seeded set per target. `make fuzz` sets FLASHLLM_FUZZ_EXAMPLES (cases per
target, random seeds) and FLASHLLM_FUZZ_REPORT (a JSON file with the counts per target)."""
from __future__ import annotations

import json
import os
import shutil
import signal
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashllm.format.reader import open_flash
from flashllm.convert.convert import convert_source
from flashllm.storage.costmodel import CostModel
from flashllm.errors import FlashError
from flashllm.storage.profile import Device, load_profile, profile_path
from flashllm.convert.registry import load_registry
from flashllm.convert.sources import open_source
from flashllm.generation.tokenizer import Tokenizer
from test_sources_gguf import hf_weights, write_gguf
from tiny_sources import ArraySource, tiny_arrays, tiny_config, write_hf_llama

ROOT = Path(__file__).resolve().parent.parent
FUZZ_EXAMPLES = int(os.environ.get("FLASHLLM_FUZZ_EXAMPLES", "0"))
REPORT = os.environ.get("FLASHLLM_FUZZ_REPORT")
CASE_SECONDS = 20            # a case running longer than this is a hang
FUZZ = settings(max_examples=FUZZ_EXAMPLES or 25, derandomize=not FUZZ_EXAMPLES, deadline=None,
                database=None, suppress_health_check=list(HealthCheck))
COUNTS: Counter = Counter()  # target -> [cases, cases that loaded, cases refused with a FlashError]


class Hang(BaseException):
    """A case that ran past CASE_SECONDS."""


@contextmanager
def time_limit(seconds: int):
    def alarm(signum, frame):
        raise Hang(f"case ran longer than {seconds} s")
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def check(target: str, action) -> None:
    """Run action: it may succeed or raise a FlashError; anything else propagates (a failure)."""
    COUNTS[target, "cases"] += 1
    with time_limit(CASE_SECONDS):
        try:
            action()
            COUNTS[target, "loaded"] += 1
        except FlashError as e:
            assert str(e) and "\n" not in str(e).strip(), f"not one line: {e!r}"
            COUNTS[target, "refused"] += 1


def mutated(data: bytes, region: int | None = None):
    """Strategy: data truncated, bit-flipped, overwritten or extended (positions within region)."""
    hi = max(min(region or len(data), len(data)) - 1, 0)
    pos = st.integers(0, hi)

    def flip(flips):
        out = bytearray(data)
        for p, bit in flips:
            out[p] ^= 1 << bit
        return bytes(out)

    def overwrite(args):
        p, junk = args
        return data[:p] + junk + data[p + len(junk):]

    return st.one_of(
        pos.map(lambda n: data[:n]),
        st.lists(st.tuples(pos, st.integers(0, 7)), min_size=1, max_size=8).map(flip),
        st.tuples(pos, st.binary(min_size=1, max_size=24)).map(overwrite),
        st.tuples(pos, st.sampled_from([b"\xff" * 8, b"\x00" * 8, b"\x7f\xff\xff\xff\xff\xff\xff\xff",
                                        b"-1", b"1e999", b'"', b"{", b"[[[[[[[["])).map(overwrite),
        st.binary(max_size=64),
    )


@contextmanager
def replaced(path: Path, data: bytes):
    original = path.read_bytes()
    path.write_bytes(data)
    try:
        yield path
    finally:
        path.write_bytes(original)


# ---- inputs: one valid file of each kind --------------------------------------------------------

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    cfg = tiny_config()
    flash = convert_source(ArraySource(cfg, tiny_arrays(cfg), chat_template=None,
                                       tokenizer_json=_tokenizer_json()), d / "flash", "q8_0")
    gguf_path = d / "tiny.gguf"
    write_gguf(gguf_path, "llama", hf_weights(__import__("numpy").random.default_rng(0), False, True),
               extra=_gguf_vocab)
    hf = write_hf_llama(d / "hf")
    cache = d / "cache"
    device = Device(254, 0, "vda")
    profile = profile_path(cache, device)
    profile.parent.mkdir(parents=True)
    profile.write_text(json.dumps(_profile_dict(device)))
    return {"flash": flash, "gguf": gguf_path, "hf": hf, "cache": cache, "device": device,
            "profile": profile, "registry": ROOT / "models.toml"}


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers
    hf = HF(models.BPE(vocab={c: i for i, c in enumerate("abcdefgh")} | {"ab": 8, "abc": 9},
                       merges=[("a", "b"), ("ab", "c")]))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    return hf.to_str()


def _gguf_vocab(w: gguf.GGUFWriter) -> None:
    tokens = [f"t{i}" for i in range(36)] + ["a", "b", "ab", "<|im_end|>"]   # 40 = the vocab size
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([1] * 39 + [3])
    w.add_token_merges(["a b"])
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def _profile_dict(device: Device) -> dict:
    cells = [{"kind": "random", "chunk": c, "threads": t, "gib_s": 0.1 * t * c / 4096, "iops": 1000.0,
              "reads": 100, "seconds": 0.5} for c in (4096, 65536) for t in (1, 4)]
    return {"device": device.__dict__, "direct": True, "file_bytes": 1 << 30,
            "created": "2026-01-01T00:00:00+0000", "cells": cells}


# ---- the readers under fuzz -----------------------------------------------------------------------

def _load_flash(folder: Path) -> None:
    flash = open_flash(folder)
    flash.read_ffn_layer(flash.config.n_layers - 1)
    Tokenizer.from_flash(flash).encode("abc abd")


def _load_source(path: Path) -> None:
    with open_source(path) as src:
        for name in src.tensor_names():
            src.load(name)
        if src.tokenizer_json:
            text = src.tokenizer_json     # a GGUF source streams it: its text()
            Tokenizer.from_json(text if isinstance(text, str) else text.text()).encode("ab a")


def _load_profile(cache: Path, device: Device) -> None:
    profile = load_profile(cache, device)
    if profile is not None:
        CostModel.from_profile(profile).best_threads(65536)


FLASH_FILES = {"manifest": ("manifest.json", None), "dense_header": ("dense.bin", 64),
               "ffn_header": ("ffn.bin", 128), "tokenizer": ("tokenizer.json", None)}


@pytest.mark.parametrize("target", list(FLASH_FILES))
def test_flash_folder_files(files, target):
    name, region = FLASH_FILES[target]
    path = files["flash"] / name

    @FUZZ
    @given(mutated(path.read_bytes(), region))
    def case(data):
        with replaced(path, data):
            check(target, lambda: _load_flash(files["flash"]))
    case()


def _json_values():
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                        st.text(max_size=8))
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                        max_leaves=6)


def _paths(obj, prefix=()):
    """Every (path) to a value inside a JSON document, lists shortened to their first items."""
    yield prefix
    items = obj.items() if isinstance(obj, dict) else enumerate(obj[:3]) if isinstance(obj, list) else ()
    for key, value in items:
        yield from _paths(value, prefix + (key,))


def test_manifest_fields_replaced_by_hostile_values(files):
    path = files["flash"] / "manifest.json"
    manifest = json.loads(path.read_text())
    paths = [p for p in _paths(manifest) if p]

    @FUZZ
    @given(st.sampled_from(paths), _json_values(), st.booleans())
    def case(where, value, delete):
        doc = json.loads(path.read_text())
        node = doc
        for key in where[:-1]:
            node = node[key]
        if delete and isinstance(node, dict):
            del node[where[-1]]
        else:
            node[where[-1]] = value
        with replaced(path, json.dumps(doc).encode()):
            check("manifest_fields", lambda: _load_flash(files["flash"]))
    case()


def test_gguf_header_and_metadata(files):
    path = files["gguf"]
    data = path.read_bytes()

    @FUZZ
    @given(mutated(data, region=4096))
    def case(mutant):
        with replaced(path, mutant):
            check("gguf", lambda: _load_source(path))
    case()


def test_safetensors_header_and_config(files):
    st_path, cfg_path = files["hf"] / "model.safetensors", files["hf"] / "config.json"
    header_end = 8 + int.from_bytes(st_path.read_bytes()[:8], "little")

    @FUZZ
    @given(st.booleans(), st.data())
    def case(config, data):
        path, region = (cfg_path, None) if config else (st_path, header_end)
        with replaced(path, data.draw(mutated(path.read_bytes(), region))):
            check("safetensors" if not config else "hf_config", lambda: _load_source(files["hf"]))
    case()


def test_models_toml(files, tmp_path):
    path = tmp_path / "models.toml"
    path.write_bytes(files["registry"].read_bytes())

    @FUZZ
    @given(mutated(files["registry"].read_bytes()))
    def case(data):
        path.write_bytes(data)
        check("models_toml", lambda: load_registry(path))
    case()


def test_profile_json(files):
    @FUZZ
    @given(mutated(files["profile"].read_bytes()))
    def case(data):
        with replaced(files["profile"], data):
            check("profile", lambda: _load_profile(files["cache"], files["device"]))
    case()


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    targets = sorted({t for t, _ in COUNTS})
    rows = {t: {k: COUNTS[t, k] for k in ("cases", "loaded", "refused")} for t in targets}
    total = sum(r["cases"] for r in rows.values())
    print(f"\nfuzz: {total} cases, 0 crashes: " + json.dumps(rows))
    if REPORT:
        Path(REPORT).write_text(json.dumps({"total": total, "crashes": 0, "targets": rows}, indent=1))
