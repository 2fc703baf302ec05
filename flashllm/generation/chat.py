"""Multi-turn chat over one model with the KV cache reused across turns.

Each turn renders the whole conversation through the chat template and tokenizes it. The tokens
whose keys/values are already in the cache (`ChatSession.cached`, positions 0..n-1) are compared
with the new rendering: the longest common prefix is kept and only the rest is prefilled (all of
it when nothing matches). When the conversation no longer fits the context, the oldest turns are
dropped (the system prompt stays) and the cache is reused as far as it still matches.

The session is plain code (testable with a scripted model); `repl` is the terminal loop around it.
"""
from __future__ import annotations

import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from flashllm.generation.chat_template import ChatError, ChatTemplate
from flashllm.generation.generate import decode_pass, prefill


@dataclass
class TurnStats:
    n_reused: int = 0          # prompt tokens whose KV entries came from earlier turns
    n_prefill: int = 0         # prompt tokens run this turn
    n_gen: int = 0             # answer tokens emitted
    n_drafted: int = 0         # draft guesses checked (--draft)
    n_accepted: int = 0        # of them kept
    prefill_s: float = 0.0
    decode_s: float = 0.0
    n_dropped: int = 0         # messages dropped to make room
    stop: str = ""             # "eos", "limit", "interrupted", "context", "complete" (a
                               # grammar that allows nothing more), "cut" (-n before it did)

    def to_dict(self) -> dict:
        return {**self.__dict__,
                "prefill_tps": self.n_prefill / self.prefill_s if self.prefill_s > 0 else 0.0,
                "decode_tps": max(self.n_gen - 1, 0) / self.decode_s if self.decode_s > 0 else 0.0}


@dataclass
class ChatSession:
    model: object                        # model.Model: forward(tokens, pos0), n_ctx, reset()
    tokenizer: object                    # tokenizer.Tokenizer
    sampler: object                      # sampler.Sampler
    template: ChatTemplate
    system: Optional[str] = None
    n_predict: int = -1                  # answer length cap; 0: a quarter of the context;
                                         # < 0: until a stop token
    messages: list = field(default_factory=list)
    cached: list = field(default_factory=list)   # token ids with valid KV at positions 0..n-1
    draft: object = None                 # speculate.NgramDraft, or None: one token per pass
    turns: list = field(default_factory=list)    # TurnStats of every turn
    n_failed: int = 0                    # messages not answered (the template or context refused)

    def __post_init__(self) -> None:
        """Refuses (ChatError) a template that cannot render a first message: it would refuse
        every one."""
        self.reset()
        self.template.render(self.messages + [{"role": "user", "content": "Hello"}])

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays). The KV entries of the system
        prompt's tokens stay valid and are reused by the next turn; the rest are forgotten."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        if self.cached:
            kept = self._render_ids(self.messages) if self.messages else []
            self.cached = self.cached[:max(0, min(common_prefix(self.cached, kept), len(kept) - 1))]

    @property
    def limit(self) -> Optional[int]:
        """The most tokens an answer may have (-n; 0: a quarter of the context), or None: until
        a stop token or the end of the context."""
        if self.n_predict < 0:
            return None
        return self.n_predict or max(1, self.model.n_ctx // 4)

    @property
    def reserve(self) -> int:
        """Room kept free for an answer when deciding whether old turns must go."""
        n_ctx = self.model.n_ctx
        return max(1, min(self.limit or n_ctx // 4, n_ctx // 2))

    def ask(self, text: str, on_text: Callable[[str], None],
            should_stop: Callable[[], bool] = lambda: False) -> TurnStats:
        """Answer the user message `text`, streaming the answer to on_text. should_stop() is
        polled between tokens (Ctrl-C): the partial answer stays in the conversation."""
        self.messages.append({"role": "user", "content": text})
        stats = TurnStats()
        try:
            ids = self._fit(stats)
        except ChatError:
            self.messages.pop()
            raise
        answer = self._answer(ids, stats, on_text, should_stop)
        self.messages.append({"role": "assistant", "content": answer})
        self.turns.append(stats)
        return stats

    def _render_ids(self, messages: list) -> list[int]:
        text = self.template.render(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special=False)

    def _fit(self, stats: TurnStats) -> list[int]:
        """The prompt ids of the conversation, dropping the oldest turns until it fits. When even
        the new message alone cannot fit, ChatError and the conversation is left as it was."""
        n_ctx, messages = self.model.n_ctx, list(self.messages)
        first = 1 if messages[0]["role"] == "system" else 0
        while True:
            ids = self._render_ids(messages)
            if not ids:
                raise ChatError(f"chat {self.template.name} rendered an empty prompt")
            alone = len(messages) - first <= 1
            if len(ids) + self.reserve <= n_ctx or (alone and len(ids) < n_ctx):
                break
            if alone:
                raise ChatError(f"this message makes a {len(ids)} token prompt; the context holds "
                                f"{n_ctx} tokens (raise --ctx-size or shorten the message)")
            drop = 2 if len(messages) - first > 2 else 1      # a user turn with its answer
            del messages[first:first + drop]
            stats.n_dropped += drop
        self.messages = messages
        return ids

    def _answer(self, ids: list[int], stats: TurnStats, on_text, should_stop) -> str:
        keep = min(common_prefix(self.cached, ids), len(ids) - 1)
        self.cached = self.cached[:keep]
        stats.n_reused, stats.n_prefill = keep, len(ids) - keep
        detok, n_ctx, limit = self.tokenizer.detokenizer(), self.model.n_ctx, self.limit
        stops, answer = set(self.tokenizer.eos_ids), []
        t0 = time.perf_counter()
        self.sampler.begin(len(ids))         # a grammar constrains each answer from its start
        logits = prefill(self.model, ids[keep:], keep,
                         allowed=self.sampler.rows_allowed(ids, [], {}))     # (vocab,)
        stats.prefill_s = time.perf_counter() - t0
        self.cached = list(ids)
        context = list(ids)                  # + the answer so far; ends with the token to feed
        new = [] if should_stop() else [self.sampler.sample(logits, context)]
        while not stats.stop:
            for token in new:
                if token in stops:
                    stats.stop = "eos"
                    break
                answer.append(token)
                context.append(token)
                stats.n_gen += 1
                on_text(detok.push(token))
                if self.sampler.finished(context):       # a complete grammar
                    stats.stop = "complete"
                    break
                if limit is not None and stats.n_gen >= limit:
                    stats.stop = "limit" if self.sampler.accepting(context) else "cut"
                    break
            if stats.stop:
                break
            pos = len(self.cached)
            if should_stop():
                stats.stop = "interrupted"
            elif pos >= n_ctx:
                stats.stop = "context"
            else:
                left = n_ctx if limit is None else limit - stats.n_gen
                new, n_guesses, seconds, _, _ = decode_pass(self.model, self.sampler, self.draft,
                                                      context, pos, min(left - 1, n_ctx - pos - 1))
                stats.decode_s += seconds
                stats.n_drafted += n_guesses
                stats.n_accepted += len(new) - 1
                self.cached += [context[-1]] + new[:-1]     # the fed token, the kept guesses
        on_text(detok.flush())
        return self.tokenizer.decode(answer)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Interrupt:
    """Ctrl-C as a flag while an answer streams: SIGINT sets it instead of raising."""

    def __init__(self) -> None:
        self.flag = False

    def __call__(self) -> bool:
        return self.flag

    @contextmanager
    def armed(self) -> Iterator["Interrupt"]:
        self.flag = False

        def handler(signum, frame):
            self.flag = True

        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


# ---- the terminal loop ------------------------------------------------------------------------

COMMANDS = {"/exit": "leave (or Ctrl-D)", "/reset": "forget the conversation",
            "/stats": "context use and speeds", "/help": "this list"}
STOP_NOTES = {"interrupted": "[answer stopped]",
              "limit": "[answer cut at the -n limit of {n} tokens: raise -n for longer answers]",
              "context": "[context full: the oldest turns are dropped on the next turn]",
              "cut": "[output cut by -n before the grammar completed ({n} tokens): raise -n]"}


@dataclass
class ReplIO:
    read: Callable[[str], str]     # input() or equivalent: raises EOFError at the end
    write: Callable[[str], None]   # answer text (stdout), flushed by the callee
    note: Callable[[str], None]    # everything else (stderr)
    color: bool = False


def prompt_text(color: bool) -> str:
    """The input prompt; ANSI colour wrapped in readline's \\001..\\002 when on a TTY."""
    return "\001\033[1;32m\002> \001\033[0m\002" if color else "> "


def repl(session: ChatSession, io: ReplIO, interrupt: Interrupt) -> int:
    """Read messages until /exit or end of input; returns the number of turns answered."""
    io.note("chat: /exit or Ctrl-D leaves, Ctrl-C stops an answer, /reset, /stats, /help")
    while True:
        try:
            line = io.read(prompt_text(io.color))
        except EOFError:
            io.note("")
            break
        except KeyboardInterrupt:
            io.note("")
            continue
        text = line.strip()
        if not text:
            continue
        if text.split()[0] in COMMANDS or (text.startswith("/") and not text.startswith("//")):
            if not _command(text, session, io):
                break
            continue
        _turn(session, io, interrupt, text.removeprefix("/"))
    return len(session.turns)


def _command(text: str, session: ChatSession, io: ReplIO) -> bool:
    """Run a /command; False means leave."""
    cmd = text.split()[0]
    if cmd in ("/exit", "/quit"):
        return False
    if cmd == "/reset":
        session.reset()
        io.note("conversation cleared")
    elif cmd == "/stats":
        io.note(stats_text(session))
    elif cmd == "/help":
        io.note("\n".join(f"  {c:8s} {what}" for c, what in COMMANDS.items())
                + "\n  //text   send a message that starts with '/'")
    else:
        io.note(f"unknown command {cmd} (commands: {', '.join(COMMANDS)}; //text sends '/text')")
    return True


def _turn(session: ChatSession, io: ReplIO, interrupt: Interrupt, text: str) -> None:
    try:
        with interrupt.armed():
            stats = session.ask(text, io.write, interrupt)
    except ChatError as e:
        session.n_failed += 1
        io.note(f"error: {e}")
        return
    io.write("\n")
    if stats.n_dropped:
        io.note(f"[{stats.n_dropped} oldest messages dropped to fit the context]")
    if stats.stop in STOP_NOTES:
        io.note(STOP_NOTES[stats.stop].format(n=stats.n_gen))


def stats_text(session: ChatSession) -> str:
    """Context use, the last turn's reuse and speeds, and totals."""
    n_ctx = session.model.n_ctx
    lines = [f"turns {len(session.turns)}, messages {len(session.messages)}, "
             f"context {len(session.cached)}/{n_ctx} tokens"]
    if session.turns:
        t = session.turns[-1].to_dict()
        lines.append(f"last turn: {t['n_reused']} prompt tokens reused, {t['n_prefill']} prefilled "
                     f"({t['prefill_tps']:.1f} t/s), {t['n_gen']} generated ({t['decode_tps']:.1f} t/s), "
                     f"stop: {t['stop']}"
                     + (f", draft: {t['n_accepted']} of {t['n_drafted']} guesses kept"
                        if t["n_drafted"] else ""))
        total = sum(t.n_gen for t in session.turns)
        reused = sum(t.n_reused for t in session.turns)
        lines.append(f"total: {total} tokens generated, {reused} prompt tokens reused from the cache")
    return "\n".join(lines)


@contextmanager
def line_editing(history_file: Optional[Path]) -> Iterator[None]:
    """readline editing and a persistent history while the block runs (when readline exists)."""
    try:
        import readline
    except ImportError:
        yield
        return
    if history_file is not None:
        try:
            readline.read_history_file(history_file)
        except OSError:
            pass
    readline.set_history_length(1000)
    try:
        yield
    finally:
        if history_file is not None:
            try:
                history_file.parent.mkdir(parents=True, exist_ok=True)
                readline.write_history_file(history_file)
            except OSError:
                pass
