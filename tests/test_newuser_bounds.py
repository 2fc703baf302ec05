"""The second new-user pass (issue 47): what a file, a stream or an option claims is bounded
before it is allocated. Each case ran out of memory (or into a traceback) before its fix; the
endless ones run in a child process whose address space is capped, so a regression ends in a
MemoryError there, not in the machine's OOM killer."""
from __future__ import annotations

import json
import os
import resource
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from flashllm.limits import loads_json, read_capped
from test_chat import tiny  # noqa: F401  (the tiny converted model fixture)

ROOT = Path(__file__).resolve().parent.parent
ADDRESS_SPACE = 6 << 30        # the child's cap: Python, numpy and torch's maps fit, /dev/zero not


def _cap() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def _flashllm(*args, **kw) -> subprocess.CompletedProcess:
    """flashllm in a child with ADDRESS_SPACE of memory: exit code, one line on stderr."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    kw.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.run([sys.executable, "-m", "flashllm", *args], capture_output=True,
                          text=True, timeout=120, env=env, preexec_fn=_cap, **kw)


def _one_error(r: subprocess.CompletedProcess, *words: str) -> str:
    """The run failed with exit code 1 and one `error:` line holding words, no traceback."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert lines and lines[-1].startswith("error: "), r.stderr[-2000:]
    assert all(w in lines[-1] for w in words), lines[-1]
    return lines[-1]


def _copy(flash, tmp_path: Path) -> Path:
    out = tmp_path / "m"
    shutil.copytree(flash.path, out)
    return out


def test_read_capped_and_loads_json():
    assert read_capped("/dev/zero", 10) is None
    assert read_capped(__file__, 1 << 20) == Path(__file__).read_bytes()
    with pytest.raises(ValueError, match="nested too deeply"):
        loads_json("[" * 200_000)


@pytest.mark.parametrize("args", [["run", "{m}", "-f", "/dev/zero"],
                                  ["run", "{m}", "-p", "-", "<zero"],
                                  ["run", "{m}", "<zero"],
                                  ["run", "{m}", "-i", "<zero"],
                                  ["run", "{m}", "-i", "--chat-template", "/dev/zero"],
                                  ["perplexity", "{m}", "/dev/zero"],
                                  ["calibrate", "{m}", "--text", "/dev/zero"]])
def test_an_endless_input_is_refused_not_read_whole(tiny, args):  # noqa: F811
    """`run -f /dev/zero` (and stdin from it, a chat fed by it, a chat template or a text file
    that never ends) read until the memory ran out: each is read up to its bound."""
    argv = [a.format(m=tiny[0].path) for a in args if a != "<zero"]
    with open("/dev/zero", "rb") as zero:
        r = _flashllm(*argv, **({"stdin": zero} if "<zero" in args else {}))
    _one_error(r, "more than")


def test_a_huge_or_deeply_nested_manifest_is_one_line(tiny, tmp_path):  # noqa: F811
    """A 1 TiB manifest.json (sparse) was read whole (a MemoryError's traceback); `[[[[…` was a
    RecursionError's."""
    m = _copy(tiny[0], tmp_path)
    with open(m / "manifest.json", "r+b") as f:
        f.truncate(1 << 40)
    _one_error(_flashllm("inspect", str(m)), "manifest.json", "more than 64 MiB")
    (m / "manifest.json").unlink()
    (m / "manifest.json").write_text("[" * 100_000)           # RecursionError: a traceback
    _one_error(_flashllm("inspect", str(m)), "manifest.json", "nested too deeply")


def test_a_huge_tokenizer_size_in_the_manifest_is_refused_before_reading(tiny, tmp_path):  # noqa: F811
    m = _copy(tiny[0], tmp_path)
    man = json.loads((m / "manifest.json").read_text())
    man["tokenizer"]["nbytes"] = 1 << 40
    (m / "manifest.json").write_text(json.dumps(man))
    with open(m / "tokenizer.json", "r+b") as f:            # the size the manifest says: sparse
        f.truncate(1 << 40)
    _one_error(_flashllm("run", str(m), "-p", "hello", "-n", "1"), "tokenizer.json", "MiB")


def _gguf_with_array(path: Path, n: int) -> Path:
    """A GGUF header (version 3, no tensors) with one metadata array of n uint8 items."""
    key = b"general.padding"
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 1))
        f.write(struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 0, n))
        f.truncate(f.tell() + n)
    return path


def test_a_gguf_array_that_decodes_past_the_bound_is_refused(tmp_path):
    """17 M one-byte items decoded to a Python list take 32 bytes each (544 MiB from a 17 MB
    file: a 10 GB file would have taken 320 GB): refused at the header's bound."""
    gguf = _gguf_with_array(tmp_path / "big.gguf", 17 << 20)
    _one_error(_flashllm("convert", str(gguf), "-o", str(tmp_path / "out")),
               "big.gguf", "more than 512 MiB")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cmd", ["perplexity", "calibrate"])
def test_a_context_no_machine_holds_is_refused_by_quality_commands(tiny, cmd):  # noqa: F811
    """`perplexity -c 999999999` made its model (a 64 GB KV cache) before looking at the text:
    a MemoryError's traceback."""
    r = _flashllm(cmd, str(tiny[0].path), "-c", "999999999", "-t", "1")
    _one_error(r, "999999999")


def test_profile_refuses_a_scratch_file_the_disk_cannot_hold(tmp_path):
    """--size 1e15 wrote until the device was full (every other program on it failing)."""
    free = shutil.disk_usage(tmp_path).free
    r = _flashllm("profile", str(tmp_path), "--size", str(free + (1 << 30)), "--seconds", "1")
    _one_error(r, "scratch file", "free")
    assert list(tmp_path.iterdir()) == []


def test_convert_refuses_a_folder_another_process_is_writing(hf_tiny, tmp_path):
    """Two `convert --force SRC -o OUT` at once renamed their files into OUT in turn: a
    manifest of one conversion over the bundles of the other. A conversion, a calibration or
    a run's own conversion of OUT holds its lock; a second convert refuses while it is held."""
    from flashllm.format.lock import exclusive
    src, _ = hf_tiny("llama")
    out = tmp_path / "m"
    assert _flashllm("convert", str(src), "-o", str(out)).returncode == 0
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir())
    with exclusive(tmp_path / ".m.lock"):
        r = _flashllm("convert", str(src), "-o", str(out), "--force", "--dtype", "f16")
    assert r.returncode == 1 and "another flashllm process is converting or calibrating" in r.stderr
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir()) == before
    assert not (tmp_path / ".m.lock").exists()


def test_a_config_field_of_the_wrong_type_is_one_line(tiny, tmp_path):  # noqa: F811
    """n_layers "2" (a string) reached the KV cache's size before the folder was validated: a
    string repeated n_ctx times, then a TypeError's traceback."""
    m = _copy(tiny[0], tmp_path)
    man = json.loads((m / "manifest.json").read_text())
    man["config"]["n_layers"] = str(man["config"]["n_layers"])
    (m / "manifest.json").write_text(json.dumps(man))
    _one_error(_flashllm("run", str(m), "-p", "hello", "-n", "1"), "n_layers='2'",
               "must be a positive integer")


def test_a_huge_draft_is_refused_not_scanned(tiny):  # noqa: F811
    """--draft 999999999 weighed every length up to it before each pass: no token in minutes."""
    r = _flashllm("run", str(tiny[0].path), "-p", "hello", "-n", "4", "--draft", "999999999")
    assert r.returncode == 2 and "'--draft'" in r.stderr and "Traceback" not in r.stderr, r.stderr
