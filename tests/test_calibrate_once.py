"""One calibration of a folder at a time, a failed one remembered and said once with the command
that does it by hand (sparsity/attempt.py, session/calibration.calibrate_once)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from flashllm.sparsity.attempt import (clear_failure, failure_path, hold, known_failure,
                                       record_failure)


def _folder(tmp_path):
    out = tmp_path / "converted" / "m-native"
    out.mkdir(parents=True)
    (out / "manifest.json").write_text('{"a": 1}')
    return out


def test_a_failure_holds_for_the_same_conversion_and_no_more_memory(tmp_path):
    out = _folder(tmp_path)
    assert known_failure(out, 100) is None
    record_failure(out, "calibrating m-native stopped (exit code -9)", 100)
    entry = json.loads(failure_path(out).read_text())        # beside the folder, not in it
    assert failure_path(out).parent == out.parent and entry["reason"].endswith("(exit code -9)")
    assert [p.name for p in out.iterdir()] == ["manifest.json"]
    assert known_failure(out, 100)["dram_budget"] == 100
    assert known_failure(out, 50) is not None                # less memory: still failing
    assert known_failure(out, 101) is None                   # more memory: worth a try
    assert known_failure(out, None) is None                  # no budget at all
    (out / "manifest.json").write_text('{"a": 2}')           # converted again
    assert known_failure(out, 100) is None
    record_failure(out, "x", None)                            # failed without a budget
    assert known_failure(out, None) is not None and known_failure(out, 10 ** 12) is not None
    clear_failure(out)
    assert not failure_path(out).exists() and known_failure(out, None) is None
    assert not [p for p in out.parent.iterdir() if ".tmp-" in p.name]


def test_a_second_calibration_waits_for_the_first_and_says_so(tmp_path):
    out = _folder(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path\n"
        "from flashllm.sparsity.attempt import hold\n"
        f"with hold(Path({str(out)!r}), print):\n"
        "    print('held', flush=True); time.sleep(2)\n")],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert holder.stdout.readline().strip() == "held"
    said, t0 = [], time.monotonic()
    with hold(out, said.append):
        waited = time.monotonic() - t0
    holder.wait(timeout=30)
    assert said == [f"waiting: another process is converting or calibrating {out}"]
    assert waited > 0.5
    said.clear()
    with hold(out, said.append):                              # free: no word
        pass
    assert said == []


@pytest.mark.realmodel
def test_a_failed_calibration_is_said_once_and_not_tried_again(tmp_path):
    """`run NAME --dram-budget B` whose calibration cannot run in B (refused: it needs more)
    goes on uncalibrated, remembers why beside the conversion, and the next run says in one
    line what is missing and the command that calibrates by hand, without trying again."""
    import shutil
    from conftest import _converted
    from flashllm.session.calibration import is_calibrated
    cache = tmp_path / "cache"
    out = cache / "converted" / "smollm2-135m-native"
    shutil.copytree(_converted("smollm2-135m", "native", lambda m: None), out)
    env = {**os.environ, "FLASHLLM_CACHE": str(cache)}
    run = lambda: subprocess.run(                                   # noqa: E731
        [sys.executable, "-m", "flashllm", "run", "smollm2-135m", "-p", "def add(a, b):", "-n",
         "4", "--temp", "0", "--dram-budget", "100MiB", "--no-timings"],
        env=env, capture_output=True, text=True, timeout=600)
    first = run()
    assert first.returncode == 0, first.stderr
    assert "calibrating" in first.stderr and "needs about" in first.stderr, first.stderr
    assert "by hand: flashllm calibrate smollm2-135m --dram-budget 100MiB" in first.stderr
    assert json.loads(failure_path(out).read_text())["dram_budget"] == 100 << 20
    second = run()
    assert second.returncode == 0, second.stderr
    lines = second.stderr.splitlines()                     # (the plan's notes name calibrate too)
    said = [line for line in lines if "calibration failed" in line]
    assert len(said) == 1 and "runs uncalibrated: its calibration failed" in said[0], said
    assert not [line for line in lines if line.startswith("calibrating")], lines
    assert said[0].endswith("calibrate it by hand: flashllm calibrate smollm2-135m "
                            "--dram-budget 100MiB")
    assert first.stdout == second.stdout
    assert not is_calibrated(json.loads((out / "manifest.json").read_text()))
