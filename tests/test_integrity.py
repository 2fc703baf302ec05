"""Checksums on first load: a corrupt model is refused by `run`, a verified one is not re-read."""
from typer.testing import CliRunner

from flashllm.format.reader import open_flash
from flashllm.cli import app
from flashllm.format.integrity import STAMP, verify_on_first_load
from tiny_sources import write_hf_llama


def _model(tmp_path):
    out = tmp_path / "m"
    r = CliRunner().invoke(app, ["convert", str(write_hf_llama(tmp_path / "src")), "-o", str(out),
                                 "--dtype", "q8_0"])
    assert r.exit_code == 0, r.output
    return out


def test_first_load_verifies_then_remembers(tmp_path):
    path = _model(tmp_path)
    assert verify_on_first_load(open_flash(path)) is True
    assert (path / STAMP).exists()
    assert verify_on_first_load(open_flash(path)) is False
    (path / "manifest.json").touch()                    # any rewrite brings the check back
    assert verify_on_first_load(open_flash(path)) is True


def test_run_refuses_a_flipped_byte_before_generating(tmp_path):
    path = _model(tmp_path)
    ffn = path / open_flash(path).manifest["ffn"]["file"]
    data = bytearray(ffn.read_bytes())
    data[4096 + 100] ^= 0x40                            # inside layer 0's first bundle
    ffn.write_bytes(bytes(data))
    r = CliRunner().invoke(app, ["run", str(path), "-p", "hi", "-n", "2", "--ctx-size", "64"])
    assert r.exit_code == 1
    last = r.output.strip().splitlines()[-1]
    assert last.startswith(f"error: {ffn}: checksum mismatch in FFN layer 0; ")
    assert "flashllm convert SOURCE -o" in last and last.endswith(" --force")
    assert not (path / STAMP).exists()
