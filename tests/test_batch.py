"""Batch jobs: `convert --jobs` with a corrupt source among good ones, disk full mid-convert,
`flashllm models` and `flashllm inspect` (summary against the files, --verify on a flipped byte)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from flashllm.format.reader import open_flash
from flashllm.convert.convert import convert_source
from flashllm.errors import FormatError
from tiny_sources import ArraySource, tiny_arrays, tiny_config, write_hf_llama

ROOT = Path(__file__).resolve().parent.parent


def flashllm(*args, env=None, timeout=120):
    """Run the CLI; env adds variables, a None value removes one."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-m", "flashllm", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout,
                          env={k: v for k, v in env.items() if v is not None})


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch")
    good = [write_hf_llama(d / "one", seed=1), write_hf_llama(d / "two", seed=2)]
    bad = d / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 3)    # a header that lies
    return good, bad


def test_convert_jobs_2_keeps_good_outputs_and_reports_the_corrupt_one(tmp_path, sources):
    (one, two), bad = sources
    proc = flashllm("convert", one, bad, two, "-o", tmp_path / "out", "--jobs", "2", "--dtype", "f32")
    assert proc.returncode == 1 and proc.stdout == ""
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and str(bad) in errors[0] and "GGUF" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and "convert summary" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["one", "two"]
    for src in (one, two):
        flash = open_flash(tmp_path / "out" / src.name, verify=True)
        want = load_file(str(src / "model.safetensors"))["model.embed_tokens.weight"]   # (40, 64)
        got = flash.tensor("token_embd.weight").data.view(np.float32)                # (40, 64)
        np.testing.assert_array_equal(got, want)


def test_disk_full_mid_convert_leaves_nothing_that_looks_valid(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        cfg = tiny_config(d_model=256, n_ff=1024, n_layers=2, vocab_size=64)     # ~6 MiB of f32
        with pytest.raises(FormatError, match="No space left on device"):
            convert_source(ArraySource(cfg, tiny_arrays(cfg)), mnt / "m", "f32")
        assert list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_inspect_summarizes_and_verify_finds_a_flipped_byte(tmp_path, sources):
    out = tmp_path / "m"
    assert flashllm("convert", sources[0][0], "-o", out, "--dtype", "q8_0").returncode == 0
    proc = flashllm("inspect", out, "--json", "--verify")
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)
    manifest = json.loads((out / "manifest.json").read_text())
    assert s["config"]["n_layers"] == 2 and s["dtype"] == "q8_0" and not s["calibrated"]
    assert s["disk_bytes"] == sum(p.stat().st_size for p in out.iterdir())
    assert s["ffn"]["nbytes"] == (out / "ffn.bin").stat().st_size == manifest["ffn"]["nbytes"]
    assert s["verified_s"] is not None
    assert "not calibrated" in flashllm("inspect", out).stdout
    with open(out / "ffn.bin", "r+b") as f:                  # flip one bit inside layer 1
        f.seek(manifest["ffn"]["layers"][1]["offset"] + 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    assert flashllm("inspect", out).returncode == 0          # sizes still fine without --verify
    proc = flashllm("inspect", out, "--verify")
    assert proc.returncode == 1 and proc.stderr.strip() == \
        f"error: {out / 'ffn.bin'}: checksum mismatch in FFN layer 1"


def test_models_lists_registry_and_cache(tmp_path):
    cache = tmp_path / "cache"
    (cache / "converted" / "smollm2-135m-q8_0").mkdir(parents=True)
    (cache / "converted" / "smollm2-135m-q8_0" / "manifest.json").write_text("{}")
    (cache / "converted" / "mine").mkdir()
    (cache / "converted" / "my-copy").mkdir()        # a manifest says what a folder holds
    (cache / "converted" / "my-copy" / "manifest.json").write_text(
        '{"dtype": "native", "sparsity": {"target": 0.5}, "predictor": null}')
    proc = flashllm("models", "--json", env={"FLASHLLM_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows["smollm2-135m"]["size"] == 98362432 and not rows["smollm2-135m"]["pulled"]
    assert [c["dtype"] for c in rows["smollm2-135m"]["converted"]] == ["q8_0"]
    assert rows["mine"]["converted"][0]["complete"] is False
    assert rows["my-copy"]["converted"][0] | {"path": "", "disk_bytes": 0} == {
        "path": "", "dtype": "native", "calibrated": True, "complete": True, "disk_bytes": 0}
    assert "qwen2.5-coder-0.5b" in rows and rows["qwen2.5-coder-0.5b"]["converted"] == []
    assert rows["smollm2-135m"]["gguf"] is None
    (cache / "models").mkdir()
    with open(cache / "models" / "smollm2-135m.gguf", "wb") as f:
        f.truncate(98362432)                                  # pulled: the size models.toml says
    rows = {r["name"]: r for r in json.loads(flashllm("models", "--json",
                                                      env={"FLASHLLM_CACHE": str(cache)}).stdout)}
    assert rows["smollm2-135m"]["gguf"] == str(cache / "models" / "smollm2-135m.gguf")
    table = flashllm("models", env={"FLASHLLM_CACHE": str(cache), "COLUMNS": "200"}).stdout
    assert "smollm2-135m" in table and "q8_0 2 B" in table and "native calibrated" in table
    assert f"fetched GGUF files: {cache / 'models'}" in table
    piped = flashllm("models", env={"FLASHLLM_CACHE": str(cache), "COLUMNS": None})  # a pipe, no
    # COLUMNS: rich would cut the cells at 80 columns
    assert piped.returncode == 0 and "…" not in piped.stdout and "qwen2.5-coder-1.5b " in piped.stdout


def test_models_with_a_broken_registry_is_one_line(tmp_path):
    bad = tmp_path / "models.toml"
    bad.write_text("[models.x]\nsize = 'big'\n")
    proc = flashllm("models", env={"FLASHLLM_MODELS": str(bad), "FLASHLLM_CACHE": str(tmp_path)})
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "models.toml entry 'x'" in proc.stderr


@pytest.mark.realmodel
@pytest.mark.parametrize("whom", ["group", pytest.param("parent", marks=pytest.mark.slow)])
def test_ctrl_c_during_convert_jobs_leaves_nothing(tmp_path, whom):
    import signal
    import time
    from conftest import gguf_path
    srcs = [gguf_path("qwen2.5-coder-0.5b"), gguf_path("smollm2-135m")]
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "flashllm", "convert", *map(str, srcs), "-o", str(out),
                             "--jobs", "2"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (out.exists() and any(p.name.startswith(".") for p in out.iterdir())):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    (os.killpg if whom == "group" else os.kill)(proc.pid, signal.SIGINT)   # Ctrl-C / kill -INT
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130 and stderr.rstrip().endswith("interrupted") and "Traceback" not in stderr
    # no temporary or lock file is left; a job that finished before the Ctrl-C (SmolLM2 is small:
    # under load it can) keeps its folder, and that folder is whole
    left = list(out.iterdir())
    assert all(not p.name.startswith(".") for p in left) and len(left) < len(srcs)
    for folder in left:
        check = flashllm("inspect", str(folder), "--verify")
        assert check.returncode == 0, check.stderr


@pytest.mark.realmodel
def test_sigterm_during_convert_leaves_nothing(tmp_path):
    import signal
    import time
    from conftest import gguf_path
    out = tmp_path / "q05"
    proc = subprocess.Popen([sys.executable, "-m", "flashllm", "convert", str(gguf_path("qwen2.5-coder-0.5b")),
                             "-o", str(out)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(".q05.tmp-") for p in tmp_path.iterdir()):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)                                    # `timeout`, `kill`
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 143 and stderr.rstrip().endswith("terminated") and "Traceback" not in stderr
    assert list(tmp_path.iterdir()) == []


def test_a_later_convert_sweeps_what_killed_ones_left(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()          # a finished pid
    for name in (f".m.tmp-{dead}", f".m.old-{dead}", f".m.tmp-{os.getpid()}x", ".other.tmp-1"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "ffn.bin").write_bytes(b"x" * 100)
    src = write_hf_llama(tmp_path / "src")
    assert flashllm("convert", src, "-o", tmp_path / "m", "--dtype", "f32").returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["src", "m", f".m.tmp-{os.getpid()}x", ".other.tmp-1"])       # only the dead writers' of m


@pytest.mark.realmodel
def test_ctrl_c_after_one_job_finished_prints_no_traceback(tmp_path):
    """A terminal's Ctrl-C reaches every worker; one whose job has finished sits idle and used to
    die with a traceback. SmolLM2 finishes long before the 0.5B: signal the group once it has."""
    import signal
    import time
    from conftest import gguf_path
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "flashllm", "convert", str(gguf_path("qwen2.5-coder-0.5b")),
                             str(gguf_path("smollm2-135m")), "-o", str(out), "--jobs", "2"], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    while not (out / "smollm2-135m" / "manifest.json").exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    time.sleep(0.3)                                         # its worker is idle now
    os.killpg(proc.pid, signal.SIGINT)
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130 and stderr.rstrip().endswith("interrupted") and "Traceback" not in stderr
    assert sorted(p.name for p in out.iterdir()) == ["smollm2-135m"]
