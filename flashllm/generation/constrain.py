"""A sampler whose choices a grammar masks (generation/grammar.py), and the drafting it allows.

ConstrainedSampler is a Sampler whose every logit outside the grammar's mask is -inf before the
chain (penalties -> top-k -> top-p -> min-p -> temperature) runs, so sample, sample_given, mode
and modes (a self draft's guesses) only ever give a token the grammar allows; an end-of-sequence
token is allowed only where the grammar accepts. Its matcher follows the history it is shown:
begin(n) marks where the constrained text starts (after the prompt), and each call consumes the
history's new tokens or rolls back the ones it no longer holds (a draft's rejected guesses).

finished(history): the grammar is complete and allows nothing more but the end, so generation
stops there without a pass. rows_allowed(history, guesses): the mask of each row a decode pass
computes, for the sparse head (runtime/sparse_head.py reads only allowed rows).

GrammarDraft proposes the grammar's forced tokens (llguidance's fast-forward tokens: bytes no
choice can change) as guesses, which verification keeps with their probability under the mask
(1 where only one token is allowed), and otherwise its inner draft's guesses cut at the first
one the grammar forbids.
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

import numpy as np

from flashllm.generation.grammar import GrammarError, TokenEnv, matcher, one_line
from flashllm.generation.sampler import Sampler, SamplerParams
from flashllm.generation.speculate import Guesses


class ConstrainedSampler(Sampler):
    """A Sampler over the tokens a grammar allows (a compiled grammar over a TokenEnv)."""

    def __init__(self, params: SamplerParams, env: TokenEnv, grammar: str):
        super().__init__(params)
        self.env = env
        self.matcher = matcher(env, grammar)
        self.start: Optional[int] = None      # history index where the constrained text starts
        self.consumed: list[int] = []         # the matcher's tokens: history[start:start + n]
        self._mask: Optional[np.ndarray] = None   # (n_vocab,) bool of the matcher's state
        self.mask_s = 0.0                     # seconds spent computing masks

    def begin(self, n_context: int) -> None:
        """The constrained text starts after the first n_context tokens of the history."""
        super().begin(n_context)
        self.matcher.reset()
        self.start, self.consumed, self._mask = n_context, [], None

    def sync(self, history: Sequence[int]) -> None:
        """Bring the matcher to history[start:]: roll back what differs, consume what is new."""
        if self.start is None:
            self.begin(len(history))
        tail, done = list(history[self.start:]), self.consumed
        same = len(done) if tail[:len(done)] == done else \
            next(i for i, (a, b) in enumerate(zip(done + [None], tail + [-1])) if a != b)
        if same < len(done):
            self.matcher.rollback(len(done) - same)
            del done[same:]
            self._mask = None
        for t in tail[same:]:
            if not self.matcher.consume_token(int(t)):
                raise GrammarError(f"token {int(t)} is outside the grammar "
                                   f"({one_line(self.matcher.get_error())})")
            done.append(int(t))
            self._mask = None

    def allowed(self, history: Sequence[int]) -> np.ndarray:
        """(n_vocab,) bool: the tokens the grammar allows after history."""
        self.sync(history)
        if self._mask is None:
            t0 = time.perf_counter()
            bits = np.frombuffer(self.matcher.compute_bitmask(), np.uint8)        # (n_vocab / 8,)
            mask = np.unpackbits(bits, bitorder="little")[:self.env.n_vocab].view(bool)
            if self.matcher.is_error() or not mask.any():
                raise GrammarError("the grammar allows no token here: "
                                   f"{one_line(self.matcher.get_error()) or 'a dead end'}")
            self._mask = mask                                                  # (n_vocab,)
            self.mask_s += time.perf_counter() - t0
        return self._mask

    def _penalized(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The chain's logits (vocab,): the repeat penalty's, -inf where the grammar forbids."""
        pen = super()._penalized(logits, history)                        # (vocab,)
        mask = self.allowed(history)                                     # (n_vocab,)
        out = np.full(len(pen), -np.inf, np.float32)                     # (vocab,)
        n = min(len(pen), len(mask))
        np.copyto(out[:n], pen[:n], where=mask[:n])
        return out

    def distribution(self, logits: np.ndarray, history: Sequence[int] = ()):
        """The chain over the allowed tokens alone (a partition over a vocabulary of mostly
        -inf is slow): the candidates and probabilities masking gives."""
        pen = super()._penalized(logits, history)                        # (vocab,)
        ids = np.flatnonzero(self.allowed(history)[:len(pen)])           # (n,)
        return self.chain(ids, pen[ids])

    def finished(self, history: Sequence[int]) -> bool:
        """True when the grammar is complete after history and allows only the end."""
        self.sync(history)
        return self.matcher.is_stopped()

    def accepting(self, history: Optional[Sequence[int]] = None) -> bool:
        """True when the text so far (history, None: what the sampler last saw) is a whole
        sentence of the grammar (an end is allowed)."""
        if history is not None:
            self.sync(history)
        return self.matcher.is_accepting()

    def forced(self, history: Sequence[int], room: int) -> list[int]:
        """Up to room tokens the grammar forces after history (llguidance's fast-forward)."""
        if room <= 0:
            return []
        self.sync(history)
        return [int(t) for t in self.matcher.compute_ff_tokens()[:room]]

    def rows_allowed(self, history: Sequence[int], guesses: Sequence[int],
                     siblings: dict) -> list[np.ndarray]:
        """The masks of a decode pass's rows: after history's last token, after each guess,
        after each sibling (sorted by guess index), as Model.forward's allowed."""
        context = list(history)
        rows = [self.allowed(context)]
        for g in guesses:
            context.append(int(g))
            rows.append(self.allowed(context))
        for j in sorted(siblings):
            rows.append(self.allowed(list(history) + list(guesses[:j]) + [siblings[j]]))
        self.sync(history)
        return rows

    def valid(self, history: Sequence[int], guesses: Guesses) -> Guesses:
        """guesses cut before the first the grammar forbids; siblings it forbids dropped."""
        context, kept = list(history), Guesses()
        for j, g in enumerate(guesses):
            mask = self.allowed(context)
            if not mask[g]:
                break
            sib = guesses.siblings.get(j)
            if sib is not None and mask[sib] and sib != g:
                kept.siblings[j] = sib
            kept.append(int(g))
            context.append(int(g))
        self.sync(history)
        return kept


class GrammarDraft:
    """A Draft (speculate.Draft) for a constrained stream: the grammar's forced tokens when it
    has some, else the inner draft's guesses (None: none) that the grammar allows."""

    def __init__(self, sampler: ConstrainedSampler, inner=None):
        self.sampler, self.inner = sampler, inner
        self._inner_turn = False          # whether the last proposal was the inner draft's
        self.n_forced = 0                 # forced tokens proposed

    def propose(self, history: Sequence[int], room: int, pos: int = 0) -> Guesses:
        forced = self.sampler.valid(history, Guesses(self.sampler.forced(history, room)))
        self._inner_turn = not forced and self.inner is not None
        if forced:
            self.n_forced += len(forced)
            return Guesses(forced)
        if self.inner is None:
            return Guesses()
        return self.sampler.valid(history, self.inner.propose(history, room, pos))

    def observe(self, n_guesses: int, n_kept: int, seconds: float,
                siblings: tuple[int, int] = (0, 0), drafting: float = 0.0) -> None:
        """The inner draft learns from its own passes only (a forced token is always kept)."""
        if self._inner_turn:
            self.inner.observe(n_guesses, n_kept, seconds, siblings, drafting)
