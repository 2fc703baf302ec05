"""Self-speculative decoding: guesses from the model's resident sub-network.

Under a DRAM budget a decode pass is bound by its reads: every neuron outside the caches, and a
streamed output head, is read each pass, and a pass over 1 + k tokens reads them once for all.
The draft is the same model computed from DRAM alone (runtime/resident.py: each FFN over its
cached neurons — those of largest contribution —, the resident attention, the head's rows for
the likely tokens): it reads nothing, so k guesses cost k of its (cheaper) token computations, and one full pass checks
them (speculate.verify: the same distribution as plain decoding, the guess kept with the
probability the sampler gives it). Unlike prompt lookup it guesses on any text.

    draft = SelfDraft(resident_model(model, head_rows), sampler, n_draft, p_min)
    generate(model, sampler, ids, n, draft=draft)

Each guess is the draft's most likely token under the sampler's chain (its penalized argmax);
drafting stops after a guess the draft itself gives less than p_min (llama.cpp's
--draft-p-min), and the number of guesses a pass checks is learned from acceptance and pass
times (speculate.DraftLength: a line through the passes' guess counts and seconds; a pass
without guesses only where the counts do not vary) — k = 0 when guessing does not pay. The
first SIBLINGS guesses may bring the draft's runner-up along (speculate.Guesses.siblings): the
pass computes it beside the chain, and where the model takes it instead of the guess it makes
one token more (Model.forward's siblings) — while enough of them are taken to pay for their
compute: a sibling costs the pass one token's place, whose seconds a line through the passes'
(tokens checked, seconds without the drafting) measures, and pays when the share of siblings
taken times the seconds a token costs is more (under a budget the pass is its reads, and a
sibling is nearly free; with the weights in DRAM it costs its compute).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from flashllm.generation.speculate import (DecayedLine, Draft, DraftError, DraftLength, Guesses,
                                           NgramDraft)


REFRESH = 16        # while the guess counts do not vary: a pass without guesses after this many
HINT_NGRAM = 3      # an n-gram of the context this long foresees the draft's next guesses
SIBLINGS = 6        # the first this many guesses may bring their runner-up as a sibling ...
SIBLING_P_MIN = 0.05  # ... when the draft gives it at least this probability, ...
SIBLING_RATE_MIN = 0.12  # ... while at least this share of the siblings checked is taken, until
                         # the passes measure what a sibling costs (a token's compute in a pass,
                         # ~1/8 of the token it makes with the weights in DRAM)
SIBLING_EXPLORE = 8  # below that share, one pass in this many still checks them
SIBLING_DECAY = 0.9  # the share is a decayed running one
PASS_TOKENS = 10     # a pass's chain and siblings together: the kernels' per-token tiles (FL_SMALL_T)
                     # go this far; beyond, GEMM panels round otherwise than one-token decoding


class SelfDraft(Draft):
    """Guesses by running the resident model ahead of the verified text, one token at a time,
    or several in one pass where the context's n-grams foresee them (propose).

    propose(history, room, pos) -> up to room guesses for positions pos + 1 ..; the resident
    model writes keys/values at pos .. pos + k - 1, which the verifying pass overwrites.
    observe(guesses, kept, seconds) after each pass (seconds: draft and pass together).
    """

    def __init__(self, model, sampler, n_draft: int, p_min: float = 0.0, hints: bool = True,
                 siblings: int = SIBLINGS):
        if n_draft < 0:
            raise DraftError(f"--draft {n_draft} must be 0 (off) or positive")
        if not 0.0 <= p_min <= 1.0:
            raise DraftError(f"--draft-p-min {p_min} must be in [0, 1]")
        self.model, self.sampler, self.p_min, self.siblings = model, sampler, p_min, siblings
        self.length = DraftLength(n_draft, refresh=REFRESH)
        self.sib_checked, self.sib_taken, self._sib_idle = 4.0, 1.0, 0  # prior share 0.25
        # a pass's seconds (drafting excluded) against the tokens it checks, and the decayed
        # seconds and tokens of the passes: what a sibling costs, and what a token is worth
        self.pass_line = DecayedLine(DraftLength.FIT_DECAY, DraftLength.SPREAD_MIN)
        self._spent, self._made = 0.0, 0.0
        self._seen = 0                  # history tokens already shown to the draft's head
        # the context's n-grams foresee some of the draft's guesses: those are computed at once
        self.hints = NgramDraft(n_draft, HINT_NGRAM, HINT_NGRAM) if hints and n_draft else None

    def observe(self, n_guesses: int, n_kept: int, seconds: float,
                siblings: tuple[int, int] = (0, 0), drafting: float = 0.0) -> None:
        """After a pass: its guesses, the tokens it made past the first, its seconds (drafting
        included), (siblings checked, taken), and the drafting's seconds."""
        self.length.observe(n_guesses, n_kept, seconds)
        self.pass_line.add(1 + n_guesses + siblings[0], seconds - drafting)
        self._spent = SIBLING_DECAY * self._spent + seconds
        self._made = SIBLING_DECAY * self._made + n_kept + 1
        if siblings[0]:
            self.sib_checked = SIBLING_DECAY * self.sib_checked + siblings[0]
            self.sib_taken = SIBLING_DECAY * self.sib_taken + siblings[1]

    def sibling_floor(self) -> float:
        """The share of siblings taken at which they pay: a token's place in a pass (the line's
        slope) over the seconds a token costs; SIBLING_RATE_MIN until the line is fitted."""
        if not self.pass_line.fitted or self._made <= 0:
            return SIBLING_RATE_MIN
        return max(self.pass_line.slope, 0.0) * self._made / self._spent

    def _sibling_room(self) -> int:
        """How many guesses of this pass may bring a sibling: none while too few are taken,
        but in one pass of SIBLING_EXPLORE, so a text where they start to pay is noticed."""
        if self.sib_taken >= self.sibling_floor() * self.sib_checked:
            return self.siblings
        self._sib_idle = (self._sib_idle + 1) % SIBLING_EXPLORE
        return self.siblings if self._sib_idle == 0 else 0

    def propose(self, history: Sequence[int], room: int, pos: int = 0) -> Guesses:
        """Up to min(room, the chosen length) guesses after history, whose last token is fed at
        pos; fewer when the draft's confidence drops below p_min.

        Where the context's n-grams foresee the next guesses (a hint), the draft computes them
        in one pass over [last token] + hint: row j is the draft's logits after hint[:j], so its
        guess is the one a token-by-token draft makes as long as each hint token before it was
        the draft's own guess; the rows after the first that differs are dropped."""
        self._show(history)
        k = min(room, self.length.choose())
        if k <= 0:
            return Guesses()
        context, guesses = list(history), Guesses()
        n_sib = min(self._sibling_room(), PASS_TOKENS - 1 - k)
        while len(guesses) < k:
            hint = self.hints.lookup(history, k - len(guesses) - 1, context[len(history):]) \
                if self.hints is not None else []
            rows = self.model.forward(np.array(context[-1:] + hint, np.int32),
                                      pos + len(guesses))                # (1 + len(hint), vocab)
            for j, logits in enumerate(rows):
                if self._take(logits, context, guesses, n_sib) or len(guesses) >= k:
                    return guesses
                if j < len(hint) and guesses[-1] != hint[j]:
                    break
        return guesses

    def _take(self, logits: np.ndarray, context: list, guesses: Guesses, n_sib: int) -> bool:
        """Append the draft's guess from logits (vocab,), and its runner-up as the guess's
        sibling where the draft finds it likely enough (among the first n_sib guesses); True
        when the draft doubts the guess."""
        token, second = self.sampler.modes(logits, context)
        p_token, p_second = _probabilities(logits, (token, second))
        if len(guesses) < n_sib and p_second >= SIBLING_P_MIN:
            guesses.siblings[len(guesses)] = second
        guesses.append(token)
        context.append(token)
        return self.p_min > 0.0 and p_token < self.p_min

    def _show(self, history: Sequence[int]) -> None:
        """The draft's head learns the tokens the context has used (their rows become held)."""
        if self._seen > len(history):
            self._seen = 0
        if self._seen < len(history):
            self.model.w.see(history[self._seen:])
        self._seen = len(history)


def _probabilities(logits: np.ndarray, tokens: Sequence[int]) -> list[float]:
    """softmax(logits)[tokens] (logits (vocab,), -inf where the draft has no row): one pass over
    the vocabulary for all of them."""
    top = float(np.max(logits))
    total = np.exp(logits - top).sum()
    return [float(np.exp(logits[t] - top) / total) for t in tokens]
