"""Bad option values are refused at parse time, naming the option the user typed (exit 2, one
`Error:` line), before any model loads; plus --version and inspect by models.toml name."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from flashllm import __version__
from flashllm.cli import app
from test_chat import tiny  # noqa: F401  (the tiny converted model fixture)

RUN_BAD = [
    (["--temp", "-1"], "'--temp'"), (["--top-k", "-3"], "'--top-k'"), (["-t", "500"], "'-t'"),
    (["-n", "-5"], "'-n'"), (["-c", "0"], "'-c'"), (["--top-p", "1.5"], "'--top-p'"),
    (["--min-p", "-0.1"], "'--min-p'"), (["--window", "0"], "'--window'"),
    (["--draft", "-1"], "'--draft'"), (["--repeat-last-n", "-2"], "'--repeat-last-n'"),
    (["--predictor", "maybe"], "'--predictor'"), (["--seed", "-2"], "'--seed'"),
    (["--temp", "nan"], "'--temp'"), (["--repeat-penalty", "nan"], "'--repeat-penalty'"),
    (["--draft-p-min", "nan"], "'--draft-p-min'"), (["--top-p", "nan"], "'--top-p'"),
    (["--min-p", "inf"], "'--min-p'"), (["--temp", "inf"], "'--temp'"),
]


def _error_line(r) -> str:
    lines = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    return lines[0]


@pytest.mark.parametrize("args, option", RUN_BAD)
def test_run_refuses_bad_values_naming_the_option(tiny, args, option):  # noqa: F811
    r = CliRunner().invoke(app, ["run", str(tiny[0].path), "-p", "hello", *args])
    assert option in _error_line(r)


@pytest.mark.parametrize("cmd", [["perplexity", "{m}", "--ctx", "0"], ["perplexity", "{m}", "-t", "0"],
                                 ["calibrate", "{m}", "--ctx", "0"], ["profile", "{d}", "--seconds", "-3"]])
def test_quality_and_profile_refuse_bad_values(tiny, tmp_path, cmd):  # noqa: F811
    args = [a.format(m=tiny[0].path, d=tmp_path) for a in cmd]
    r = CliRunner().invoke(app, args)
    assert f"'{cmd[2]}'" in _error_line(r)
    assert list(tmp_path.iterdir()) == []          # profile measured nothing, saved nothing


def test_seed_minus_one_is_random_as_in_llama_cpp(tiny):  # noqa: F811
    r = CliRunner().invoke(app, ["run", str(tiny[0].path), "-p", "hello", "-n", "2", "--seed", "-1"])
    assert r.exit_code == 0, r.output


def test_convert_of_a_converted_folder_says_what_it_is(tiny, tmp_path):  # noqa: F811
    r = CliRunner().invoke(app, ["convert", str(tiny[0].path), "-o", str(tmp_path / "out")])
    assert r.exit_code == 1 and "already a converted flashllm model" in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_version():
    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output == f"flashllm {__version__}\n"


def test_help_shows_no_type_placeholders_for_flags():
    r = CliRunner().invoke(app, ["run", "--help"])
    assert r.exit_code == 0 and "<bool>" not in r.output and "--naive" in r.output


def test_inspect_takes_a_models_toml_name_like_run(tiny, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("FLASHLLM_CACHE", str(tmp_path))
    out = tmp_path / "converted" / "smollm2-135m-q8_0"
    out.parent.mkdir()
    out.symlink_to(tiny[0].path)                          # as if `run smollm2-135m` had converted it
    r = CliRunner().invoke(app, ["inspect", "smollm2-135m", "--json"])
    assert r.exit_code == 0 and '"arch"' in r.output, r.output
    r = CliRunner().invoke(app, ["inspect", "gpt-9"])
    assert r.exit_code == 1 and "no such model 'gpt-9'" in r.output


@pytest.mark.parametrize("target, said", [
    ("/dev/null", "error: /dev/null is neither a folder (to write a scratch file in) nor a regular file"),
    ("/proc", "error: a 4 MiB scratch file would leave less than 1024 MiB of the 0 MiB free in "
              "/proc"),                                   # nothing written (it reports 0 free)
])
def test_profile_on_what_cannot_hold_a_scratch_file_is_one_line(target, said, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHLLM_CACHE", str(tmp_path))
    r = CliRunner().invoke(app, ["profile", target, "--seconds", "1", "--size", "4MiB"])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith(said), r.output
    assert list(tmp_path.iterdir()) == []                               # no profile saved


def test_an_unusable_cache_folder_is_one_line(tiny, monkeypatch):  # noqa: F811
    monkeypatch.setenv("FLASHLLM_CACHE", "/proc/flashllm-cache")       # cannot be made
    r = CliRunner().invoke(app, ["run", "smollm2-135m", "-p", "hi", "-n", "2"])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "/proc/flashllm-cache" in lines[0]
