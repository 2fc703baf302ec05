"""A calibration killed for real (SIGKILL in a child `flashllm calibrate`, at the moment it opens or
removes a given file) or failing on a write (a file-size limit: the errno of a full disk) leaves
the old folder or the new one: it verifies, its predictor loads, its logits are transformers',
and the next calibration removes what the killed one left (sparsity/reorder.py's module doc)."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys

import pytest

from test_calibrate import TOKENS, _fresh, _logits_match, tiny  # noqa: F401 (the fixture)

from flashllm.format.files import named_files
from flashllm.format.reader import open_flash
from flashllm.sparsity.predictor import load_predictor

# `flashllm ARGV...` that SIGKILLs itself (or, with "full", fails as a full disk does) at the
# Nth audit event EVENT (open, os.rename, os.remove) whose path holds PART: a real kill at a real
# point of the real code
KILL_AT = """
import errno, os, runpy, signal, sys
event, part, n, how = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
seen = []
def hook(ev, args):
    if ev == event and args and part in str(args[0]):
        seen.append(1)
        if len(seen) == n and how == "full":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(args[0]))
        if len(seen) == n:
            os.kill(os.getpid(), signal.SIGKILL)
sys.addaudithook(hook)
sys.argv = ["flashllm"] + sys.argv[5:]
runpy.run_module("flashllm", run_name="__main__")
"""


def _calibrate_args(path, text, sparsity: float) -> list[str]:
    return ["calibrate", str(path), "--text", str(text), "--tokens", "48", "--ctx", "24",
            "--sparsity", str(sparsity), "-t", "1", "--keep-target"]


def _child(args: list[str], kill_at: tuple = (), **kw) -> subprocess.CompletedProcess:
    code = ["-c", KILL_AT, *map(str, kill_at)] if kill_at else ["-m", "flashllm"]
    return subprocess.run([sys.executable, *code, *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, **kw)


@pytest.fixture
def calibrated(tiny, tmp_path):  # noqa: F811 (the fixture imported above)
    """A tiny llama folder calibrated once (hot-first files, a predictor), the text file."""
    path = _fresh(tiny, "llama", tmp_path)
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{i}" for i in TOKENS), encoding="utf-8")
    r = _child(_calibrate_args(path, text, 0.5))
    assert r.returncode == 0, r.stderr
    return path, text


def _check_old_or_new(hf, path, before: bytes) -> dict:
    """The folder is the old one or the complete new one (target 0.4 and its predictor), every
    checksum right, its logits transformers'; its manifest."""
    man = json.loads((path / "manifest.json").read_bytes())
    if (path / "manifest.json").read_bytes() != before:
        assert man["sparsity"]["target"] == 0.4 and man["predictor"]["kind"] == "gate_up"
    flash = open_flash(path, verify=True)
    assert load_predictor(flash) is not None and man["sparsity"]["hot_first"]
    _logits_match(hf, path, TOKENS[:40])
    return man


# (audit event, path part, n): the rewrite starting, the new FFN file in place but not named,
# the predictor being written, the manifest's switch, the old files' removal after it
POINTS = {"rewrite": ("open", ".ffn.bin.tmp", 1), "ffn written": ("open", ".order", 1),
          "predictor": ("open", ".predictor", 1), "switch": ("open", ".manifest.json.tmp", 1),
          "after the switch": ("os.remove", "ffn-hot.bin", 1)}


@pytest.mark.parametrize("point", list(POINTS))
def test_a_calibration_killed_leaves_the_old_folder_or_the_new_one(tiny, calibrated, point):  # noqa: F811
    path, text = calibrated
    hf = tiny("llama")[0]
    before = (path / "manifest.json").read_bytes()
    r = _child(_calibrate_args(path, text, 0.4), (*POINTS[point], "kill"))
    assert r.returncode == -signal.SIGKILL, r.stderr
    man = _check_old_or_new(hf, path, before)
    assert ((path / "manifest.json").read_bytes() == before) == (point != "after the switch")
    r = _child(_calibrate_args(path, text, 0.4))                     # the next one finishes
    assert r.returncode == 0, r.stderr
    man = _check_old_or_new(hf, path, before)
    assert man["sparsity"]["target"] == 0.4
    left = {p.name for p in path.iterdir()} - {".verified"}
    assert left == named_files(man) | {"manifest.json"}              # nothing stray


def test_a_calibration_out_of_space_says_so_and_keeps_the_old_folder(tiny, calibrated):  # noqa: F811
    """A write that fails (RLIMIT_FSIZE below the FFN file's size: EFBIG, what ENOSPC takes in
    the same code) ends the command with one line and exit code 1, the folder as it was."""
    path, text = calibrated
    hf = tiny("llama")[0]
    before = (path / "manifest.json").read_bytes()
    ffn = open_flash(path).ffn.file.stat().st_size

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (ffn // 2, ffn // 2))
    r = _child(_calibrate_args(path, text, 0.4), preexec_fn=limit)
    assert r.returncode == 1 and "cannot write" in r.stderr and "File too large" in r.stderr, \
        r.stderr
    assert "Traceback" not in r.stderr and (path / "manifest.json").read_bytes() == before
    assert not [p.name for p in path.iterdir() if ".tmp-" in p.name]
    _check_old_or_new(hf, path, before)


@pytest.mark.parametrize("point", ["predictor", "switch"])
def test_a_full_disk_after_the_new_ffn_file_leaves_nothing_behind(tiny, calibrated, point):  # noqa: F811
    """No space for the predictor or the manifest, once the new FFN file is written: one line,
    exit code 1, the old folder, and none of the new files left to fill the disk."""
    path, text = calibrated
    before = (path / "manifest.json").read_bytes()
    r = _child(_calibrate_args(path, text, 0.4), (*POINTS[point], "full"))
    assert r.returncode == 1 and "No space left on device" in r.stderr.splitlines()[-1], r.stderr
    assert "Traceback" not in r.stderr and (path / "manifest.json").read_bytes() == before
    man = _check_old_or_new(tiny("llama")[0], path, before)
    assert {p.name for p in path.iterdir()} - {".verified"} == named_files(man) | {"manifest.json"}
