"""A chat template is untrusted code from a downloaded file: renders are bounded in size and time
and refused with one ChatError line (issue 47: `{{ 'a' * 10**10 }}` grew `run -i` to 23.7 GB; a
range(10**9) loop gave a traceback); a template that cannot render a first message is refused
before the chat starts, and a chat whose messages were refused exits 1; a Gemma file without a
template gets Gemma's turn markers, as llama.cpp's built-in "gemma" template writes them."""
from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flashllm.cli import app
from flashllm.generation.chat import ChatSession
from flashllm.generation.chat_template import ChatError, ChatTemplate, load_template
from flashllm.generation.template_sandbox import MAX_CHARS, MAX_SECONDS
from test_chat import CONVERSATION, _session, tiny  # noqa: F401  (the tiny converted model fixture)

FIXTURE = Path(__file__).parent / "fixtures" / "llamacpp" / "gemma-chat.json"

HOSTILE = [
    "{{ 'a' * 10**10 }}",                                           # 10 GB of one string
    "{% for x in range(10**9) %}{% endfor %}",                       # past jinja's own range limit
    "{{ 'a'|center(10**9) }}", "{{ 'ab'.center(10**9) }}", "{{ 'x'|indent(10**9) }}",
    "{{ [1] * 10**8 }}", "{{ 10 ** 10 ** 10 }}",
    "{{ '%0999999999d' % 1 }}", "{{ '{:999999999}'.format(1) }}", "{{ '%0999999999d'|format(1) }}",
    "{% set ns = namespace(x='a') %}{% for i in range(40) %}{% set ns.x = ns.x + ns.x %}"
    "{% endfor %}{{ ns.x }}",                                         # doubling with +
    "{% set ns = namespace(x='a') %}{% for i in range(40) %}{% set ns.x = ns.x ~ ns.x %}"
    "{% endfor %}{{ ns.x }}",                                         # doubling with ~
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # 10^10 steps
    "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",      # 100 MB of output
]


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("source", HOSTILE)
def test_a_hostile_template_is_one_chat_error_in_bounded_time_and_memory(source):
    before, t0 = _peak_mib(), time.monotonic()
    with pytest.raises(ChatError, match="refused|failed to render") as e:
        ChatTemplate(source).render(CONVERSATION)
    assert "\n" not in str(e.value)
    assert time.monotonic() - t0 < MAX_SECONDS + 3
    assert _peak_mib() - before < 64 * MAX_CHARS / 2**20     # no value past the limit was made


def test_ordinary_template_work_stays_allowed():
    text = ChatTemplate("{% for m in messages %}{{ m['role'] * 2 ~ '|' ~ m['content']|upper }}"
                        "{% endfor %}{{ '%05d' % 7 }}{{ '{:>6}'.format('x') }}"
                        "{{ messages|tojson }}").render(CONVERSATION)
    assert text.startswith("systemsystem|YOU ARE TERSE.") and "00007     x[{" in text


def test_a_template_that_refuses_every_message_is_refused_before_the_chat(tiny):  # noqa: F811
    ok = _session(tiny)
    bad = ChatTemplate("{{ raise_exception('this template takes no system role') }}")
    with pytest.raises(ChatError, match="takes no system role"):
        ChatSession(ok.model, ok.tokenizer, ok.sampler, bad, system="hello")


def test_a_chat_whose_template_raises_exits_1_with_one_line(tiny, tmp_path):  # noqa: F811
    template = tmp_path / "t.jinja"
    template.write_text("{{ raise_exception('no chat here') }}", encoding="utf-8")
    r = CliRunner().invoke(app, ["run", str(tiny[0].path), "-i", "--chat-template", str(template)],
                           input="hello\nthere\n")
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 1 and len(errors) == 1 and "no chat here" in errors[0], r.output


def test_a_chat_with_a_refused_message_exits_1(tiny, tmp_path):  # noqa: F811
    """The template refuses only a message that says 'forbidden': that turn is an error line,
    the next is answered, and the exit code says something was not answered."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{% if 'forbidden' in m['content'] %}"
                        "{{ raise_exception('refused') }}{% endif %}{{ m['content'] }} "
                        "{% endfor %}", encoding="utf-8")
    r = CliRunner().invoke(app, ["run", str(tiny[0].path), "-i", "-n", "2", "--chat-template",
                                 str(template)], input="forbidden\nhello\n")
    assert r.exit_code == 1 and "1 message(s) were not answered" in r.output, r.output


def test_gemma_without_a_template_gets_gemma_turns_as_llama_cpp_writes_them():
    """llama.cpp's built-in "gemma" template (llama_chat_apply_template, recorded by
    scripts/fixtures/make_chat_fixtures.py) with the model's BOS in front: flashllm's
    tokenizer adds no special tokens to a rendered chat."""
    cases = json.loads(FIXTURE.read_text(encoding="utf-8"))["cases"]
    template, origin = load_template(None, None, "<bos>", "<eos>", "gemma3")
    assert origin.startswith("Gemma turns")
    for case in cases:
        assert template.render(case["messages"]) == "<bos>" + case["llama_cpp"], case
    assert load_template(None, None, "", "", "qwen2")[1] == "ChatML fallback"
