"""convert / convert_many / `flashllm convert`: progress, atomicity, batch behaviour, and one clear
error line per bad source; plus a real conversion of SmolLM2 checked against gguf-py."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from flashllm.format.reader import open_flash
from flashllm.cli import app
from flashllm.convert.batch import convert_many
from flashllm.convert.convert import convert, convert_source
from flashllm.errors import FormatError, SourceError
from tiny_sources import ArraySource, ref_rows, tiny_arrays, tiny_config, write_hf_llama

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def source():
    cfg = tiny_config()
    return ArraySource(cfg, tiny_arrays(cfg, seed=3))


def _raise_at(n, exc):
    calls = []

    def progress(done, total):
        calls.append(done)
        if len(calls) == n:
            raise exc
    return progress


def test_convert_source_reports_progress_and_round_trips(tmp_path, source):
    seen = []
    out = convert_source(source, tmp_path / "m", "q4_0", progress=lambda d, t: seen.append((d, t)))
    total = sum(4 * a.size for a in source.arrays.values())
    assert seen[-1] == (total, total) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    flash = open_flash(out, verify=True)
    x = source.arrays["token_embd.weight"]                                  # (40, 64)
    np.testing.assert_array_equal(flash.tensor("token_embd.weight").data, ref_rows(x, "q4_0"))
    down = source.arrays["blk.1.ffn_down.weight"]                           # (64, 96)
    pb = flash.ffn.part_bytes
    np.testing.assert_array_equal(flash.read_ffn_layer(1)[:, 2 * pb:3 * pb],
                                  ref_rows(np.ascontiguousarray(down.T), "q4_0"))


@pytest.mark.parametrize("call, exc", [(2, RuntimeError("boom")), (5, KeyboardInterrupt()),
                                       (-1, RuntimeError("in the FFN section"))])
def test_an_exception_mid_write_leaves_nothing(tmp_path, source, call, exc):
    n_dense = len(source.arrays) - 3 * source.config.n_layers
    n_calls = call if call > 0 else n_dense + 1                           # after FFN layer 0
    with pytest.raises(type(exc)):
        convert_source(source, tmp_path / "m", "q8_0", progress=_raise_at(n_calls, exc))
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_kept_without_force_and_replaced_with_it(tmp_path, source):
    out = convert_source(source, tmp_path / "m", "q8_0")
    with pytest.raises(FormatError, match="already exists"):
        convert_source(source, out, "f16")
    assert open_flash(out).dtype == "q8_0"
    convert_source(source, out, "f16", force=True)
    assert open_flash(out).dtype == "f16"
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


@pytest.mark.parametrize("kind", ["folder", "file", "link"])
def test_force_never_replaces_what_is_not_a_flash_model(tmp_path, source, kind):
    out = tmp_path / "d"
    if kind == "folder":
        out.mkdir()
        (out / "keep").write_text("mine")
    elif kind == "file":
        out.write_text("mine")
    else:
        (tmp_path / "target").mkdir()
        out.symlink_to(tmp_path / "target")
    with pytest.raises(FormatError, match="is not a flash model folder"):
        convert_source(source, out, "f16", force=True)
    if kind == "folder":
        assert (out / "keep").read_text() == "mine" and len(list(out.iterdir())) == 1
    elif kind == "file":
        assert out.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["d"] + (["target"] if kind == "link" else []))


def test_force_never_replaces_the_source_or_its_folder(tmp_path):
    src = write_hf_llama(tmp_path / "hf")
    for out in (src, src.parent):
        code, out_text, err = _cli([src, "-o", out, "--force", "--dtype", "f32"])
        assert code == 1 and "holds the source" in err, err
    assert (src / "config.json").is_file() and any(src.glob("*.safetensors"))


def test_a_source_missing_a_tensor_is_refused_before_writing(tmp_path, source):
    del source.arrays["blk.1.attn_v.weight"]
    with pytest.raises(SourceError, match="no tensor blk.1.attn_v.weight"):
        convert_source(source, tmp_path / "m", "q8_0")
    del source.arrays["blk.0.ffn_gate.weight"]
    source.arrays["blk.1.attn_v.weight"] = np.zeros((24, 64), np.float32)
    with pytest.raises(SourceError, match=r"layer 0: FFN weights \['down', 'up'\]"):
        convert_source(source, tmp_path / "m", "q8_0")
    assert list(tmp_path.iterdir()) == []


# ---- real files through convert_many and the CLI ----------------------------------------------

@pytest.fixture
def bad_sources(tmp_path):
    """name -> a source path that must fail with one line naming it."""
    pickle_file = tmp_path / "pytorch_model.bin"
    pickle_file.write_bytes(b"\x80\x04\x95" + bytes(64))
    truncated = write_hf_llama(tmp_path / "truncated")
    st = truncated / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    unknown = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(unknown), "mamba9")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"pickle": pickle_file, "truncated": truncated, "unknown arch": unknown}


def test_convert_many_batch_keeps_going_after_a_failure(tmp_path, bad_sources):
    good = write_hf_llama(tmp_path / "good-llama")
    console = Console(file=open(tmp_path / "log.txt", "w"), width=200)
    failures = convert_many([bad_sources["pickle"], good], tmp_path / "out", "q8_0", False, console)
    console.file.close()
    assert [src for src, _ in failures] == [bad_sources["pickle"]]
    assert open_flash(tmp_path / "out" / "good-llama", verify=True).config.n_layers == 2
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["good-llama"]
    errors = [ln for ln in (tmp_path / "log.txt").read_text().splitlines() if "error" in ln]
    assert errors == [f"error: {failures[0][1]}"]


def _cli(args):
    result = CliRunner().invoke(app, ["convert", *map(str, args)])
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("case, message", [
    ("pickle", "pickle checkpoints are never unpickled"),
    ("truncated", "model.safetensors"),
    ("unknown arch", "mamba9"),
])
def test_cli_bad_source_prints_one_clear_line(tmp_path, bad_sources, case, message):
    code, stdout, stderr = _cli([bad_sources[case], "-o", tmp_path / "out"])
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert code == 1 and stdout == ""
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], stderr
    assert str(bad_sources[case]) in lines[0]
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_cli_unwritable_output_and_success(tmp_path):
    src = write_hf_llama(tmp_path / "llama")
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, stderr = _cli([src, "-o", blocker / "out"])
    assert code == 1 and stderr.strip().splitlines() == [stderr.strip()]
    want = f"error: {src}: cannot write the flash model to {blocker / 'out'}: Not a directory"
    assert stderr.strip() == want
    assert blocker.read_text() == ""
    code, _, stderr = _cli([src, "-o", tmp_path / "new" / "ok", "--dtype", "f32"])
    assert code == 0, stderr  # missing parent folders are made, like mkdir -p
    assert open_flash(tmp_path / "new" / "ok", verify=True).dtype == "f32"


def test_cli_subprocess_exit_code_and_stderr(tmp_path, bad_sources):
    good = write_hf_llama(tmp_path / "good")
    proc = subprocess.run([sys.executable, "-m", "flashllm", "convert", str(good),
                           str(bad_sources["unknown arch"]), "-o", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1 and proc.stdout == ""
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and "mamba9" in errors[0] and "mamba.gguf" in errors[0], proc.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["good"]


@pytest.mark.realmodel
def test_real_smollm2_q8_0_matches_gguf_py(tmp_path):
    from conftest import gguf_path
    smollm = gguf_path("smollm2-135m")
    flash = open_flash(convert(smollm, tmp_path / "smol", "q8_0"), verify=True)
    cfg = flash.config
    assert (cfg.n_layers, cfg.d_model, cfg.n_ff, cfg.tied_embeddings) == (30, 576, 1536, True)
    assert flash.tokenizer_json and not flash.has("output.weight")
    reader = gguf.GGUFReader(str(smollm))
    tensors = {t.name: t for t in reader.tensors}

    def ref(name):                                                          # (rows, cols) f32
        t = tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1, int(t.shape[0]))
    np.testing.assert_array_equal(flash.tensor("token_embd.weight").data,
                                  ref_rows(ref("token_embd.weight"), "q8_0"))
    bundles, pb = flash.read_ffn_layer(29), flash.ffn.part_bytes            # (1536, stride)
    np.testing.assert_array_equal(bundles[:, :pb], ref_rows(ref("blk.29.ffn_gate.weight"), "q8_0"))
    down_t = np.ascontiguousarray(ref("blk.29.ffn_down.weight").T)          # (1536, 576)
    np.testing.assert_array_equal(bundles[:, 2 * pb:3 * pb], ref_rows(down_t, "q8_0"))


def test_cli_refuses_an_unknown_dtype_at_parse_time(tmp_path):
    code, out, err = _cli([tmp_path, "-o", tmp_path / "out", "--dtype", "q3_k"])
    said = " ".join(err.replace("│", " ").split())                       # unwrap Rich's box
    assert code == 2 and out == "" and "'q3_k' is not one of 'native', 'f32', 'f16'" in said
    assert not (tmp_path / "out").exists()


def test_a_source_without_a_tokenizer_converts_with_a_warning(tmp_path):
    src = write_hf_llama(tmp_path / "llama")                        # config + safetensors only
    code, out, err = _cli([src, "-o", tmp_path / "m", "--dtype", "f32"])
    said = " ".join(err.split())
    assert code == 0 and f"warning: {src} has no tokenizer" in said, err
    assert "`flashllm run` cannot encode a prompt for it" in said
    (src / "tokenizer.json").write_text(_word_tokenizer())
    code, out, err = _cli([src, "-o", tmp_path / "m2", "--dtype", "f32"])
    assert code == 0 and "warning" not in err, err


def _word_tokenizer() -> str:
    from tokenizers import Tokenizer, models
    return Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).to_str()


def test_progress_in_a_log_is_plain_lines_with_true_totals(tmp_path):
    src = write_hf_llama(tmp_path / "llama")
    (src / "tokenizer.json").write_text(_word_tokenizer())
    stored = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    proc = subprocess.run([sys.executable, "-m", "flashllm", "convert", str(src), "-o",
                           str(tmp_path / "m"), "--dtype", "f32"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 0 and lines[-1] == f"llama → {tmp_path / 'm'}", proc.stderr
    assert lines[-2].startswith("llama: 100% (") and "━" not in proc.stderr
    done, total = lines[-2].split("(")[1].rstrip(")").split(" of ")
    from flashllm.units import parse_size
    assert done == total and abs(parse_size(total.replace(" ", "")) - stored) < 0.1 * stored
