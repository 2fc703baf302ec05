"""The one thread that owns the model: requests come in through a bounded queue, each is given a
slot (a network with its own KV cache). Each round, one decode pass carries the next token of
every answering slot (runtime/batch.py: one forward pass, so the FFN's flash reads serve them
all), then the prompts waiting run their next chunks (PREFILL_CHUNK tokens in all a round): a
new request joins at the next round, and a long prompt never stalls the answers for more than
one chunk. HTTP handlers never
touch the model: they put a Job in the queue and read its events.

A job's events, in order: ("start", n_prompt), ("text", piece)..., ("done", finish_reason,
n_prompt, n_gen, n_cached); or one ("error", ApiError). n_cached: the prompt tokens whose keys
and values the slot already held. A job that asks for logprobs also gets ("logprob", entry)
for each token made, before its text (serve/logprobs.py). A job whose client went away
(cancelled) leaves its slot at the next pass. A slot keeps its KV cache after a job: the next
job whose prompt starts with the same tokens prefills only the rest (the slot with the longest
such prefix is chosen).
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from flashllm.errors import FlashError
from flashllm.generation.chat import common_prefix
from flashllm.generation.sampler import Sampler
from flashllm.generation.speculate import Guesses, verify_tree
from flashllm.runtime.batch import ROW_TILE, pass_rows, verify_rows
from flashllm.serve.api import ApiError, Ask
from flashllm.serve.drafting import job_drafter, propose
from flashllm.serve.stops import StopText
from flashllm.serve.tools import render

PREFILL_CHUNK = 256          # prompt tokens a round prefills (of all slots)
FORGET_EVERY = 256           # decode passes between drops of the FFN's per-pass records
SHARED_ROWS = ROW_TILE       # prompts' chunks, and answers' tokens with their draft guesses,
                             # share a pass up to this many rows: the FFN's quantized paths
                             # give each row its own numbers up to 10 tokens (GEMM panels
                             # above: docs/KERNELS.md, ffn_quant.c)


PIECE_CHARS = 16384          # a longer prompt is first counted in pieces of this many characters


def count_over(tok, text: str, limit: int):
    """At least how many tokens text has, when that is limit or more (it cannot fit a context
    of limit tokens with room for an answer), told from pieces of PIECE_CHARS characters cut
    before a space and encoded one at a time (a whole encode of a 1 MB prompt held ~150 MB at
    once); None when it may fit. A cut can change the tokens at its edges: 2 a piece are
    allowed for."""
    n, start = 0, 0
    while start < len(text):
        end = min(len(text), start + PIECE_CHARS)
        if end < len(text):
            cut = text.rfind(" ", start + 1, end)
            end = cut if cut > start else end
        n += len(tok.encode(text[start:end], add_special=False)) - 2
        if n >= limit:
            return n
        start = end
    return None


class Busy(Exception):
    """The queue is full, or the server is stopping: 503."""


@dataclass
class Job:
    ask: Ask
    emit: Callable[[tuple], None]                 # thread-safe: called by the worker
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class Slot:
    """A stream: its network (KV cache), the tokens whose keys and values it holds, and the
    job it is running (None: free)."""

    net: object
    stream: int = 0                               # its index (its drafts' resident model)
    cached: list = field(default_factory=list)    # token ids at positions 0 .. len-1
    job: Optional[Job] = None
    history: list = field(default_factory=list)   # prompt + answer ids
    fed: int = 0                                  # positions whose KV is in the cache
    n_prompt: int = 0
    n_cached: int = 0                             # prompt tokens the slot already held
    n_gen: int = 0
    limit: int = 0
    sampler: object = None
    detok: object = None
    stop: object = None
    draft: object = None                          # the job's drafter (None: no guesses)

    @property
    def prefilling(self) -> bool:
        return self.fed < self.n_prompt


class Worker:
    """The model's thread over an Engine (serve/model.py)."""

    def __init__(self, engine, queue_size: int = 64, chunk: int = PREFILL_CHUNK):
        self.engine = engine
        self.slots = [Slot(net, i) for i, net in enumerate(engine.nets)]
        self.carries = engine.drafts.carries() if engine.drafts is not None else \
            [None] * len(engine.nets)           # each stream's ColdCarry (a self draft's)
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.chunk = chunk
        self.passes = self.rows = 0         # decode passes run, and the streams they carried
        self.proposed = self.accepted = 0   # draft guesses checked, and kept
        self._turn = 0                      # which stream of a pass drafts first
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="flashllm-model", daemon=True)

    # ---- the HTTP side (any thread) ----------------------------------------------------------

    def submit(self, job: Job) -> None:
        if self.stopping.is_set():
            raise Busy("the server is shutting down")
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise Busy(f"the queue is full ({self.queue.maxsize} requests waiting); retry "
                       "later") from None

    def counts(self) -> dict:
        busy = sum(s.job is not None for s in self.slots)
        return {"slots_idle": len(self.slots) - busy, "slots_processing": busy,
                "queued": self.queue.qsize(), "decode_passes": self.passes,
                "decode_rows": self.rows, "draft_proposed": self.proposed,
                "draft_accepted": self.accepted}

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop: queued jobs get a 503, active ones are cancelled (their clients are gone by
        now: the server closes connections first), then the thread ends."""
        self.stopping.set()
        for slot in self.slots:
            if slot.job is not None:
                slot.job.cancelled.set()
        self.thread.join(timeout)

    # ---- the model's thread ------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            self._admit()
            active = [s for s in self.slots if s.job is not None]
            if not active:
                if self.stopping.is_set():
                    break
                continue
            self._pass(active)
            if self.passes % FORGET_EVERY == 0:
                self.engine.forget_records()
        self._refuse_queued()

    def _admit(self) -> None:
        """Give queued jobs the free slots; wait a little for one when every slot is idle."""
        idle = all(s.job is None for s in self.slots)
        while any(s.job is None for s in self.slots) and not self.stopping.is_set():
            try:
                job = self.queue.get(timeout=0.1) if idle else self.queue.get_nowait()
            except queue.Empty:
                return
            idle = False
            if not job.cancelled.is_set():
                self._start(job)
        if self.stopping.is_set():
            self._refuse_queued()

    def _refuse_queued(self) -> None:
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return
            job.emit(("error", ApiError(503, "the server is shutting down",
                                        kind="server_error", code="shutting_down")))

    def _start(self, job: Job) -> None:
        """Tokenize the job's prompt, check it fits, and put it in the best free slot."""
        try:
            ids = self._prompt_ids(job.ask)
            sampler = self._sampler(job.ask)
        except ApiError as e:
            job.emit(("error", e))
            return
        free = [s for s in self.slots if s.job is None]
        slot = max(free, key=lambda s: common_prefix(s.cached, ids))
        keep = min(common_prefix(slot.cached, ids), len(ids) - 1)
        n_ctx = self.engine.n_ctx
        limit = n_ctx - len(ids) + 1          # the last token made is never fed
        slot.job, slot.history, slot.fed, slot.n_prompt, slot.n_gen = job, list(ids), keep, \
            len(ids), 0
        slot.cached, slot.n_cached = slot.cached[:keep], keep
        slot.limit = min(job.ask.max_tokens or limit, limit)
        slot.sampler = sampler
        slot.sampler.begin(len(ids))
        slot.detok = self.engine.tok.detokenizer()
        slot.stop = StopText(job.ask.stops)
        slot.draft = job_drafter(self.engine.drafts, slot.stream, slot.sampler, job.ask.grammar)
        job.emit(("start", len(ids)))

    def _sampler(self, ask: Ask) -> Sampler:
        """The job's sampler: constrained by its response_format's grammar (each stream its own
        matcher over the model's token table, built at the first such job)."""
        if ask.grammar is None:
            return Sampler(ask.params)
        from flashllm.generation.constrain import ConstrainedSampler
        try:
            return ConstrainedSampler(ask.params, self.engine.token_env(), ask.grammar)
        except FlashError as e:
            raise ApiError(400, f"response_format: {e}", "response_format") from None

    def _prompt_ids(self, ask: Ask) -> list:
        eng, param = self.engine, "messages" if ask.chat else "prompt"
        try:
            text = render(eng.template, list(ask.messages), ask.tools, eng.name) \
                if ask.chat else ask.prompt
            n = None if len(text) <= PIECE_CHARS else count_over(eng.tok, text, eng.n_ctx)
            ids = [] if n is not None else eng.tok.encode(text, add_special=not ask.chat)
        except FlashError as e:
            raise ApiError(400, str(e), param) from None
        if n is None and not ids:
            raise ApiError(400, "the prompt is empty (no tokens to start from)", "prompt")
        if n is not None or len(ids) >= eng.n_ctx:
            has = f"at least {n}" if n is not None else len(ids)
            raise ApiError(400, f"This model's context holds {eng.n_ctx} tokens per stream; "
                           f"the prompt has {has} (no room for an answer)", param,
                           "context_length_exceeded")
        return ids

    def _pass(self, active: list) -> None:
        """Cancelled jobs leave; one decode pass carries the next token of every answering
        slot; then the prompts waiting run their next chunks."""
        for slot in active:
            if slot.job.cancelled.is_set():
                self._finish(slot, "cancelled")
        answering = [s for s in active if s.job is not None and not s.prefilling]
        if answering:
            self._guarded(answering, self._decode)
        filling = [s for s in active if s.job is not None and s.prefilling]
        if filling:
            self._guarded(filling, self._prefill)

    def _guarded(self, slots: list, step: Callable) -> None:
        """step(slots); a failure fails their jobs (500), not the server."""
        try:
            step(slots)
        except Exception as e:
            for slot in slots:
                slot.job.emit(("error", ApiError(500, f"the model failed: {e}",
                                                 kind="server_error")))
                slot.fed, slot.job, slot.cached, slot.draft = 0, None, [], None

    def _decode(self, slots: list) -> None:
        """The next token of every slot, ROW_TILE slots a pass (more would change each row's
        sums: runtime/batch.py)."""
        for a in range(0, len(slots), ROW_TILE):
            self._decode_pass(slots[a:a + ROW_TILE])

    def _decode_pass(self, group: list) -> None:
        """One pass over each slot's fed token and its draft's guesses (generation/speculate:
        the tokens kept are distributed as without them), then each slot's new tokens."""
        self._turn += 1
        proposals = propose(group, SHARED_ROWS, self._turn, self.engine.n_ctx)   # [(Guesses, s)]
        chunks, sibs = [], []
        for slot, (g, _) in zip(group, proposals):
            order = sorted(g.siblings)
            chunks.append(slot.history[-1:] + list(g) + [g.siblings[j] for j in order])
            sibs.append([1 + j for j in order])
        t0 = time.perf_counter()
        rows = verify_rows([s.net for s in group], chunks, [s.fed for s in group], sibs,
                           [self.carries[s.stream] for s in group])   # [(1 + k + S, vocab)]
        seconds = time.perf_counter() - t0
        self.passes += 1
        self.rows += len(group)
        for slot, (guesses, drafting), logits in zip(group, proposals, rows):
            self._verified(slot, guesses, logits, seconds + drafting, drafting)

    def _verified(self, slot: Slot, guesses: Guesses, rows, seconds: float,
                  drafting: float) -> None:
        """The tokens a pass's rows (1 + k + S, vocab) give slot (speculate.verify_tree: its
        guesses kept, then one more), each sent until the answer ends."""
        sib, pos = guesses.siblings, slot.fed
        new, kept = verify_tree(slot.sampler, rows, guesses, sib, slot.history)
        if kept is not None:                  # the sibling of guess j stands at pos + 1 + j
            slot.net.keep_sibling(kept, pos + 1 + sorted(sib)[kept])
        if slot.draft is not None:
            slot.draft.observe(len(guesses), len(new) - 1, seconds,
                               (len(sib), int(kept is not None)), drafting)
        self.proposed += len(guesses)
        self.accepted += len(new) - 1
        for j, token in enumerate(new):
            slot.fed = pos + 1 + j       # the token after a taken sibling: from its row
            row = rows[1 + len(guesses) + kept] if kept is not None and j == len(new) - 1 \
                else rows[j]                                              # (vocab,)
            if not self._emit(slot, token, row):
                return

    def _prefill(self, slots: list) -> None:
        """The next chunks of the prompts waiting, self.chunk tokens in all a round (at least
        one chunk). A prompt's chunks end at fixed places (multiples of self.chunk past where
        its prefill began), and chunks share a pass only while the pass stays within
        SHARED_ROWS rows, so a prompt's numbers never depend on other requests. A prompt's last
        chunk also samples its first token."""
        spent, group = 0, []
        for slot in slots:
            start = slot.fed - slot.n_cached
            end = min(slot.n_prompt, slot.n_cached + (start // self.chunk + 1) * self.chunk)
            if spent and spent + end - slot.fed > self.chunk:
                break
            if group and sum(len(c) for _, c in group) + end - slot.fed > SHARED_ROWS:
                self._prefill_pass(group)
                group = []
            group.append((slot, slot.history[slot.fed:end]))
            spent += end - slot.fed
        self._prefill_pass(group)

    def _prefill_pass(self, group: list) -> None:
        """One pass over [(slot, its chunk)]; a slot whose prompt is done samples."""
        rows = pass_rows([s.net for s, _ in group], [c for _, c in group],
                         [s.fed for s, _ in group], prefill=True,
                         carries=[self.carries[s.stream] for s, _ in group])   # (B, vocab)
        for (slot, chunk), logits in zip(group, rows):
            slot.fed += len(chunk)
            if not slot.prefilling:
                self._advance(slot, logits)

    def _advance(self, slot: Slot, logits) -> None:
        """Sample the slot's next token from logits (vocab,) and send its text, or finish."""
        self._emit(slot, slot.sampler.sample(logits, slot.history), logits)

    def _emit(self, slot: Slot, token: int, logits) -> bool:
        """Send the slot's next token's text (and its logprobs from logits (vocab,), the row it
        was drawn from, when the job asks), or finish; False when the answer has ended."""
        if token in self.engine.tok.eos_ids:
            self._finish(slot, "stop")
            return False
        if slot.job.ask.logprobs is not None:
            self._logprob(slot, logits, token)
        slot.history.append(token)
        slot.n_gen += 1
        text, stopped = slot.stop.push(slot.detok.push(token))
        if text:
            slot.job.emit(("text", text))
        if stopped:
            self._finish(slot, "stop", flush=False)
        elif slot.sampler.finished(slot.history):     # a complete response_format
            self._finish(slot, "stop")
        elif slot.n_gen >= slot.limit or slot.fed >= self.engine.n_ctx:
            self._finish(slot, "length")
        return slot.job is not None

    def _logprob(self, slot: Slot, logits, token: int) -> None:
        """The logprobs of the token the slot just sampled from logits (vocab,), sent before
        its text."""
        from flashllm.serve.logprobs import entry
        slot.job.emit(("logprob", entry(slot.sampler, self.engine.tok, logits, slot.history,
                                        token, slot.job.ask.logprobs)))

    def _finish(self, slot: Slot, reason: str, flush: bool = True) -> None:
        job = slot.job
        if flush and reason != "cancelled":
            text, _ = slot.stop.push(slot.detok.flush())
            text += slot.stop.flush()
            if text:
                job.emit(("text", text))
        job.emit(("done", reason, slot.n_prompt, slot.n_gen, slot.n_cached))
        slot.cached = slot.history[:slot.fed]
        slot.job = slot.draft = None

