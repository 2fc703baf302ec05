"""Chat: templates rendered as transformers renders them, a session whose KV-cache reuse across
turns gives the same answers as recomputing the whole conversation, context-full handling, Ctrl-C,
and (realmodel) a pexpect-recorded terminal session with SmolLM2-135M."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from flashllm.format.reader import open_flash
from flashllm.generation.chat import ChatSession, Interrupt, ReplIO, repl
from flashllm.generation.chat_template import CHATML, ChatError, ChatTemplate, load_template
from flashllm.convert.convert import convert_source
from flashllm.runtime.model import Model
from flashllm.generation.sampler import Sampler, SamplerParams
from flashllm.generation.tokenizer import Tokenizer
from tiny_sources import ArraySource, tiny_arrays, tiny_config

ROOT = Path(__file__).resolve().parent.parent
GGUFS = {"smollm2": "smollm2-135m", "qwen": "qwen2.5-coder-0.5b"}   # models.toml names
WORDS = ["[UNK]", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "hello", "there",
         "how", "are", "you", "fine", "thanks", "a", "b", "c"]
CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]


def _gguf_template(name: str) -> str:
    from conftest import gguf_path
    from gguf import GGUFReader
    return GGUFReader(gguf_path(name)).fields["tokenizer.chat_template"].contents()


@pytest.mark.parametrize("which", [pytest.param("smollm2", marks=pytest.mark.realmodel),
                                   pytest.param("qwen", marks=pytest.mark.realmodel), "chatml"])
def test_templates_render_as_transformers_does(which):
    reference = pytest.importorskip("transformers.utils.chat_template_utils")
    source = CHATML if which == "chatml" else _gguf_template(GGUFS[which])
    for messages in (CONVERSATION, CONVERSATION[1:2]):
        want = reference.render_jinja_template([messages], chat_template=source,
                                               add_generation_prompt=True)
        want = want[0][0] if isinstance(want, tuple) else want
        assert ChatTemplate(source).render(messages) == want


@pytest.mark.parametrize("source, message", [
    ("{% for %}", "does not compile"),
    ("{{ raise_exception('no system role') }}", "no system role"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "failed to render"),   # sandbox escape
    ("{{ messages[7]['content'] }}", "failed to render"),
    ("", "is empty"),
])
def test_bad_templates_are_one_chat_error(source, message):
    with pytest.raises(ChatError, match=message):
        ChatTemplate(source).render(CONVERSATION)


def test_template_override_wins_and_chatml_is_the_fallback():
    assert load_template("{{ 'model' }}", "{{ 'file' }}", "", "")[0].render([]) == "file"
    assert load_template(None, None, "", "")[1] == "ChatML fallback"


# ---- a tiny converted model with a word-level tokenizer --------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = tiny_config(vocab_size=len(WORDS), eos_token_ids=(2,), context_length=256)
    hf = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens([AddedToken(w, special=True, normalized=False) for w in WORDS[1:3]])
    src = ArraySource(cfg, tiny_arrays(cfg, seed=5), tokenizer_json=hf.to_str(), chat_template=CHATML)
    flash = open_flash(convert_source(src, tmp_path_factory.mktemp("chat") / "m", "f32"))
    return flash, Tokenizer.from_flash(flash)


def _session(tiny, n_ctx=128, n_predict=5, system="hello there"):
    flash, tok = tiny
    return ChatSession(Model(flash, n_threads=1, n_ctx=n_ctx), tok,
                       Sampler(SamplerParams(temp=0.0)), ChatTemplate(flash.chat_template),
                       system=system, n_predict=n_predict)


def _recomputed_answer(flash, tok, messages, n_predict):
    """Greedy answer from scratch: every step runs the whole sequence from position 0."""
    ids = tok.encode(ChatTemplate(CHATML).render(messages), add_special=False)
    model, out = Model(flash, n_threads=1, n_ctx=128), []
    for _ in range(n_predict):
        token = int(np.argmax(model.forward(np.array(ids + out), 0)[-1]))   # (vocab,) -> id
        if token in tok.eos_ids:
            break
        out.append(token)
    return out


def test_kv_reuse_across_turns_matches_recomputing_the_conversation(tiny):
    flash, tok = tiny
    chat, texts = _session(tiny), []
    for question in ("hello how are you", "fine thanks", "a b c"):
        before = list(chat.messages) + [{"role": "user", "content": question}]
        pieces = []
        stats = chat.ask(question, pieces.append)
        want = _recomputed_answer(flash, tok, before, 5)
        assert "".join(pieces) == tok.decode(want) == chat.messages[-1]["content"]
        n_prompt = len(tok.encode(ChatTemplate(CHATML).render(before), add_special=False))
        assert stats.n_reused + stats.n_prefill == n_prompt
        texts.append(stats)
    assert texts[0].n_reused == 0
    for prev, turn in zip(texts, texts[1:]):          # at least the previous prompt is reused
        assert turn.n_reused >= prev.n_reused + prev.n_prefill


def test_ctrl_c_keeps_the_partial_answer_and_the_next_turn_continues(tiny):
    chat, polls = _session(tiny), []
    stats = chat.ask("hello", lambda s: None, should_stop=lambda: polls.append(1) or len(polls) > 2)
    assert stats.stop == "interrupted" and stats.n_gen == 2
    assert len(tiny[1].encode(chat.messages[-1]["content"], add_special=False)) <= 2
    assert chat.ask("you", lambda s: None).n_reused > 0


def test_a_full_context_drops_the_oldest_turns_but_keeps_the_system_prompt(tiny):
    chat = _session(tiny, n_ctx=48, n_predict=4)
    dropped = sum(chat.ask("hello how are you", lambda s: None).n_dropped for _ in range(5))
    assert dropped > 0 and chat.messages[0] == {"role": "system", "content": "hello there"}
    assert len(chat.cached) <= 48
    with pytest.raises(ChatError, match="context holds 48 tokens"):
        chat.ask("hello " * 60, lambda s: None)
    assert chat.messages[-1]["role"] == "assistant"


def test_reset_forgets_the_conversation_and_reuses_the_system_prompt(tiny):
    chat = _session(tiny)
    chat.ask("hello", lambda s: None)
    chat.reset()
    assert chat.messages == [{"role": "system", "content": "hello there"}]
    assert chat.ask("you", lambda s: None).n_reused >= 5


def test_repl_commands_and_end_of_input(tiny):
    chat, lines, out, notes = _session(tiny), iter(["hi", "/stats", "/bogus", "", "/reset", "//x"]), [], []

    def read(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    assert repl(chat, ReplIO(read, out.append, notes.append), Interrupt()) == 2
    text = "\n".join(notes)
    assert "turns 1" in text and "unknown command /bogus" in text and "conversation cleared" in text
    assert chat.messages[1] == {"role": "user", "content": "/x"}


# ---- the real terminal session ---------------------------------------------------------------

@pytest.mark.realmodel
def test_terminal_session_with_smollm2(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    from conftest import _converted
    model = _converted("smollm2-135m", "f32", log=lambda m: print(m, file=sys.stderr))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLASHLLM_CACHE": str(tmp_path / "cache"),
           "TERM": "dumb", "NO_COLOR": "1"}
    child = pexpect.spawn(sys.executable, ["-m", "flashllm", "run", str(model), "-i", "-c", "512",
                                           "--temp", "0", "-n", "64", "-t", "2"],
                          env=env, cwd=str(tmp_path), encoding="utf-8", timeout=300)
    child.logfile_read = open(tmp_path / "session.log", "w")
    child.expect_exact("> ")
    child.sendline("What is the capital of France?")
    child.expect("Paris")
    child.expect_exact("> ")
    child.sendline("Write a long story about a dragon.")
    child.expect_exact("dragon.\r\n")               # the echo of the line typed
    child.expect(r"\w+ \w+ \w+")                   # the answer is streaming
    child.sendintr()                              # Ctrl-C mid-answer
    child.expect_exact("[answer stopped]")
    child.expect_exact("> ")
    child.sendline("/stats")
    child.expect(r"turns 2, messages 4, context \d+/512 tokens\r\nlast turn: (\d+) prompt tokens reused"
                 r", \d+ prefilled .*, (\d+) generated .* stop: interrupted")
    assert int(child.match.group(1)) > 30 and int(child.match.group(2)) >= 3
    child.expect_exact("> ")
    child.sendline("/reset")
    child.expect_exact("conversation cleared")
    child.expect_exact("> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    print((tmp_path / "session.log").read_text(), file=sys.stderr)
    assert child.exitstatus == 0


def test_stats_after_reset_and_the_limit_note(tiny):
    chat = _session(tiny, n_predict=2)
    lines, notes = iter(["hello there", "/stats", "/reset", "/stats"]), []

    def read(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    repl(chat, ReplIO(read, lambda s: None, notes.append), Interrupt())
    stats = [n for n in notes if n.startswith("turns")]
    used = int(stats[0].split("context ")[1].split("/")[0])
    after = int(stats[1].split("context ")[1].split("/")[0])
    rendered = ChatTemplate(CHATML).render(chat.messages, add_generation_prompt=True)
    system_only = len(tiny[1].encode(rendered, add_special=False)) - 1   # its tokens stay cached
    assert used > after and after <= system_only and "messages 1," in stats[1]
    assert chat.turns[0].stop == "limit"
    assert "[answer cut at the -n limit of 2 tokens: raise -n for longer answers]" in notes
    assert chat.ask("you", lambda s: None).n_reused == after     # and are reused


def test_without_n_an_answer_runs_to_a_quarter_of_the_context(tiny):
    """`run -i` without -n passes n_predict 0: answers up to n_ctx // 4 tokens (they were cut
    after the first token)."""
    chat = _session(tiny, n_ctx=64, n_predict=0)
    stats = chat.ask("how are you", lambda s: None)
    want = _recomputed_answer(tiny[0], tiny[1], chat.messages[:-1], 16)
    assert len(want) > 1 and stats.n_gen == len(want)
    assert stats.stop == ("limit" if len(want) == 16 else "eos")
