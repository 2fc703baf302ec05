"""`flashllm run -j/--json-schema, --json-schema-file, --grammar-file` (and in `-i` chat) on
SmolLM2: outputs validated by jsonschema, a schema that does not compile refused in one line
before any model loads, an answer cut by -n noted on stderr."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from conftest import _converted  # noqa: E402
from flashllm.cli.app import app  # noqa: E402
from scripts.bench.grammar import SCHEMAS  # noqa: E402

PROMPT = "Write a JSON record (name, age, email) for a fictional person: a sailmaker."


@pytest.fixture(scope="module")
def model():
    return str(_converted("smollm2-135m", "native", log=lambda m: None))


def run(*args, stdin=None):
    return CliRunner().invoke(app, ["run", *args], input=stdin)


def test_bad_schema_is_one_line_before_the_model_loads(tmp_path):
    missing = str(tmp_path / "no-such-model")              # never opened: the schema fails first
    for args, says in [(["-j", '{"type": "objec'], "the JSON schema is not valid JSON"),
                       (["-j", '{"type": "string", "minLength": 4, "maxLength": 2}'],
                        "the JSON schema does not compile"),
                       (["--json-schema-file", str(tmp_path / "none.json")],
                        "cannot read the JSON schema file"),
                       (["-j", "{}", "--grammar-file", str(tmp_path / "g.gbnf")],
                        "give one of -j/--json-schema")]:
        r = run(missing, "-p", "x", *args)
        assert r.exit_code == 1, r.output
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], r.stderr
    (tmp_path / "bad.gbnf").write_text('root ::= "a" undefined\n')
    r = run(missing, "-p", "x", "--grammar-file", str(tmp_path / "bad.gbnf"))
    assert r.exit_code == 1 and "the grammar does not compile" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.realmodel
def test_json_schema_file_output_validates(model, tmp_path):
    schema = SCHEMAS["object"]
    (tmp_path / "s.json").write_text(json.dumps(schema))
    for seed in (1, 2):
        r = run(model, "-p", PROMPT, "-n", "160", "--temp", "0.8", "--seed", str(seed),
                "--json-schema-file", str(tmp_path / "s.json"), "--json")
        assert r.exit_code == 0, r.output
        jsonschema.validate(json.loads(r.stdout), schema)
        stats = json.loads(r.stderr.strip().splitlines()[-1])
        assert stats["grammar"]["complete"] and stats["grammar"]["forced"] > 0
        assert "cut by -n" not in r.stderr


@pytest.mark.realmodel
def test_cut_by_n_is_noted(model):
    r = run(model, "-p", PROMPT, "-n", "6", "--temp", "0", "-j", json.dumps(SCHEMAS["nested"]),
            "--no-timings")
    assert r.exit_code == 0, r.output
    assert "output cut by -n before the grammar completed" in r.stderr
    with pytest.raises(ValueError):
        json.loads(r.stdout)


@pytest.mark.realmodel
def test_gbnf_file(model, tmp_path):
    (tmp_path / "list.gbnf").write_text(
        '# a short list of words\nroot ::= item ("," " "? item){1,3}\nitem ::= [a-z]{2,10}\n')
    r = run(model, "-p", "Three fruits, comma separated:", "-n", "64", "--temp", "0.8",
            "--seed", "3", "--grammar-file", str(tmp_path / "list.gbnf"), "--no-timings")
    assert r.exit_code == 0, r.output
    import re
    assert re.fullmatch(r"[a-z]{2,10}(, ?[a-z]{2,10}){1,3}", r.stdout), r.stdout


@pytest.mark.realmodel
def test_each_chat_answer_is_constrained(model):
    schema = SCHEMAS["enum"]
    r = run(model, "-i", "-j", json.dumps(schema), "-n", "80", "--temp", "0.8", "--seed", "5",
            stdin="How does a rainy Monday feel?\nAnd a sunny Saturday?\n")
    assert r.exit_code == 0, r.output
    answers, at, text = [], 0, r.stdout                    # each answer, then a newline
    while text[at:].strip():
        at += len(text[at:]) - len(text[at:].lstrip())
        value, at = json.JSONDecoder().raw_decode(text, at)
        answers.append(value)
    assert len(answers) == 2, r.stdout
    for a in answers:
        jsonschema.validate(a, schema)
