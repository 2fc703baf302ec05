"""Shell pipelines: tokens alone on stdout, everything else on stderr, stdin and `-` prompts,
exit codes (0 ok, 1 user error, 2 usage), `| head -c 1` ending quietly, two runs sharing one
flash model at once; and (realmodel) `echo ... | flashllm run smollm2-135m | wc -w`."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from test_chat import tiny  # noqa: F401  (the tiny converted model fixture)

ROOT = Path(__file__).resolve().parent.parent
FLASHLLM = f"{shlex.quote(sys.executable)} -m flashllm"


def sh(script: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """Run a bash pipeline; the exit status of every stage is the last line of stderr."""
    return subprocess.run(["bash", "-c", script + '; echo "status ${PIPESTATUS[*]}" >&2'],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"})


def statuses(proc) -> list[int]:
    return [int(s) for s in proc.stderr.strip().splitlines()[-1].split()[1:]]


@pytest.fixture(scope="module")
def model(tiny):  # noqa: F811
    return shlex.quote(str(tiny[0].path))


def test_stdin_prompt_tokens_alone_on_stdout(model):
    proc = sh(f"echo 'hello there how' | {FLASHLLM} run {model} -n 16 --seed 3")
    assert statuses(proc) == [0, 0]
    words = proc.stdout.split()
    assert 0 < len(words) <= 16 and all(w in ("hello", "there", "how", "are", "you", "fine", "thanks",
                                              "a", "b", "c", "system", "user", "assistant", "[UNK]")
                                        for w in words), proc.stdout
    assert "eval time" in proc.stderr and "eval time" not in proc.stdout


def test_wc_counts_the_words_of_the_answer(model):
    alone = sh(f"{FLASHLLM} run {model} -p 'hello there' -n 12 --temp 0 --no-timings")
    for dash in ("-p -", "-f -"):
        piped = sh(f"echo 'hello there' | {FLASHLLM} run {model} {dash} -n 12 --temp 0 | wc -w")
        assert statuses(piped) == [0, 0, 0]
        assert int(piped.stdout) == len(alone.stdout.split())


def test_head_c_1_ends_quietly(model):
    proc = sh(f"echo 'hello' | {FLASHLLM} run {model} -n 200 --seed 1 | head -c 1")
    assert statuses(proc) == [0, 0, 0] and len(proc.stdout) == 1
    assert "Traceback" not in proc.stderr and "Exception" not in proc.stderr and "Broken" not in proc.stderr


@pytest.mark.parametrize("args, code, message", [
    ("run /nonexistent/model -p hi", 1, "error: no such model"),
    ("run {model} -p hi --top-p 7", 2, "Invalid value for '--top-p'"),
    ("run {model} -p hi --top-p 0", 1, "error: top_p=0.0 must be in (0, 1]"),
    ("run {model} --bogus-option", 2, "No such option"),
    ("inspect", 2, "Missing argument"),
])
def test_exit_codes(model, args, code, message):
    proc = sh(f"{FLASHLLM} {args.format(model=model)} < /dev/null")
    assert statuses(proc) == [code] and proc.stdout == ""
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_two_runs_share_one_flash_model_at_once(model, tmp_path):
    one = f"{FLASHLLM} run {model} -p 'hello there' -n 24 --temp 0 --no-timings"
    a, b = (shlex.quote(str(tmp_path / n)) for n in "ab")
    proc = sh(f"{one} > {a} & p1=$!; {one} > {b} & p2=$!; wait $p1; s1=$?; wait $p2; echo $s1 $? >&2")
    assert proc.stderr.strip().splitlines()[-2] == "0 0", proc.stderr
    first, second = (tmp_path / "a").read_text(), (tmp_path / "b").read_text()
    assert first.strip() and first == second == sh(one).stdout


def test_json_stats_on_stderr_tokens_alone_on_stdout(model):
    proc = sh(f"{FLASHLLM} run {model} -p 'hello there' -n 6 --temp 0 --json 2>&1 >/dev/null")
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stats["n_prompt"] == 2 and 0 <= stats["n_gen"] <= 6 and stats["prefill_s"] > 0
    assert statuses(proc) == [0]


def test_piped_chat_with_a_system_prompt_and_a_template_file(model, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }} {{ messages[-1]['content'] }}")
    proc = sh(f"printf 'how are you\\n/stats\\n/exit\\n' | {FLASHLLM} run {model} -i -sys 'hello there' "
              f"--chat-template {shlex.quote(str(template))} -n 6 --temp 0")
    one_shot = sh(f"{FLASHLLM} run {model} -p 'hello there how are you' -n 6 --temp 0 --no-timings")
    assert statuses(proc) == [0, 0]
    assert proc.stdout == one_shot.stdout + "\n"    # answers alone on stdout, a line each; a
                                                    # one-shot run adds no newline off a terminal
    assert "chat template: --chat-template" in proc.stderr and "turns 1, messages 3" in proc.stderr


def test_chat_refuses_a_prompt_too(model):
    proc = sh(f"{FLASHLLM} run {model} -i -p hi")
    assert statuses(proc) == [1] and "error: give a prompt (-p/-f) or -i/--chat, not both" in proc.stderr


def test_a_missing_kernel_build_is_one_actionable_line(model, tmp_path):
    # sys.modules[name] = None makes `import name` fail as if the module were not built, whatever
    # the install mode (an editable install's finder would win over a PYTHONPATH copy)
    code = ("import sys; sys.modules['flashllm.ffi._native'] = None; from flashllm.cli import main; "
            f"sys.argv = ['flashllm', 'run', {shlex.split(model)[0]!r}, '-p', 'hi']; main()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: ")
    assert "flashllm.ffi._native" in lines[0] and "make setup" in lines[0]


@pytest.mark.realmodel
def test_real_smollm2_pipeline_word_count():
    from conftest import _converted
    path = shlex.quote(str(_converted("smollm2-135m", "f32", log=lambda m: print(m, file=sys.stderr))))
    proc = sh(f"echo 'The capital of France is' | {FLASHLLM} run {path} -n 8 --temp 0 -t 2 | wc -w",
              timeout=600)
    assert statuses(proc) == [0, 0, 0] and 1 <= int(proc.stdout) <= 8
    head = sh(f"echo 'Once upon a time' | {FLASHLLM} run {path} -n 8 -t 2 | head -c 1", timeout=600)
    assert statuses(head) == [0, 0, 0] and len(head.stdout) == 1 and "Traceback" not in head.stderr


@pytest.mark.realmodel
def test_run_takes_a_gguf_file_as_llamacpp_users_pass_it(tmp_path):
    """`flashllm run FILE.gguf`: converted once into the user cache (FLASHLLM_CACHE), then the
    same tokens as the models.toml name's conversion of the same file."""
    from conftest import gguf_path
    gguf = tmp_path / "SmolLM2.gguf"
    os.symlink(gguf_path("smollm2-135m"), gguf)
    cache = shlex.quote(str(tmp_path / "cache"))
    run = f"{FLASHLLM} run {{}} -p 'The capital of France is' -n 8 --temp 0 --no-timings"
    first = sh(f"FLASHLLM_CACHE={cache} " + run.format(shlex.quote(str(gguf))), timeout=600)
    again = sh(f"FLASHLLM_CACHE={cache} " + run.format(shlex.quote(str(gguf))), timeout=600)
    named = sh(run.format("smollm2-135m"), timeout=600)
    assert statuses(first) == statuses(again) == statuses(named) == [0]
    assert "SmolLM2.gguf: converting to" in first.stderr and "converting" not in again.stderr
    assert first.stdout == again.stdout == named.stdout and first.stdout.strip()


@pytest.mark.parametrize("feed", ["printf 'hello caf\\xe9\\n' | {f} run {m} -n 3 --temp 0",
                                  "printf 'hello caf\\xe9\\n' | {f} run {m} -p - -n 3 --temp 0",
                                  "{f} run {m} -n 3 --temp 0 -p \"$(printf 'hello caf\\xe9')\"",
                                  "printf 'hello caf\\xe9\\n' > p.txt; {f} run {m} -f p.txt -n 3 --temp 0",
                                  "printf 'caf\\xe9 hello\\nhello there\\n' | {f} run {m} -i -n 3 --temp 0"])
def test_invalid_utf8_prompts_are_replaced_with_a_warning(model, tmp_path, feed):
    proc = sh(f"cd {shlex.quote(str(tmp_path))}; " + feed.format(f=FLASHLLM, m=model))
    assert set(statuses(proc)) == {0} and "Traceback" not in proc.stderr, proc.stderr
    assert "is not valid UTF-8: 1 invalid byte sequence(s) replaced with U+FFFD" in proc.stderr
    assert proc.stdout.strip()
