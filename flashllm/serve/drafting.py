"""A decode pass's draft guesses (serve/worker.py): a job's drafter, as `run` drafts, and the
rows a pass may carry beyond its fed tokens shared among the streams in it."""
from __future__ import annotations

import time
from typing import Optional

from flashllm.generation.speculate import Guesses


def job_drafter(drafts, stream: int, sampler, grammar: Optional[str]):
    """A job's drafter on stream: its draft's (session StreamDrafts; None: drafting is off); a
    grammar's (response_format's, a forced tool call's) forced tokens guessed first, as `run`
    drafts a constrained stream (session/structured.py)."""
    inner = drafts.new(stream, sampler) if drafts is not None else None
    if grammar is None:
        return inner
    from flashllm.session.structured import grammar_draft
    return grammar_draft(sampler, inner)


def propose(group: list, rows: int, turn: int, n_ctx: int) -> list:
    """[(Guesses, drafting seconds)] a slot of group (serve/worker.Slot): the rows a pass may
    carry (rows in all) beyond the slots' fed tokens shared fairly, a share each in turn
    (turn: which slot goes first; it changes each pass), what one leaves going to the next: a
    lone stream gets `run`'s 9 of 10; a slot's guesses also stop where its answer or the
    context (n_ctx) must end."""
    spare, out = rows - len(group), [(Guesses(), 0.0)] * len(group)
    for n in range(len(group)):
        i = (turn + n) % len(group)
        slot = group[i]
        if slot.draft is None:
            continue
        t0 = time.perf_counter()
        share = -(-spare // (len(group) - n))                               # ceil
        room = min(share, slot.limit - slot.n_gen - 1, n_ctx - slot.fed - 1)
        guesses = slot.draft.propose(slot.history, max(room, 0), slot.fed).cut(share)
        spare -= guesses.rows
        out[i] = (guesses, time.perf_counter() - t0)
    return out
