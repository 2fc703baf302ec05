"""Token sampling in llama.cpp's chain order: banned tokens → penalties → top-k → top-p → min-p →
temperature → draw.

The penalties: llama.cpp's repeat penalty over the last repeat_last_n tokens of the history, then
OpenAI's presence and frequency penalties over the tokens made since begin() (the answer so far:
logit[j] -= count[j] * frequency + (count[j] > 0) * presence).

Each stage narrows a candidate set (token ids with their logits). temp <= 0 is greedy: the
penalized argmax. The draw uses a numpy Generator seeded from SamplerParams.seed (None: random).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from flashllm.errors import FlashError


class SamplerError(FlashError):
    """Sampler settings that make no sense (negative top-k, top-p outside (0, 1], ...)."""


@dataclass(frozen=True)
class SamplerParams:
    temp: float = 0.8
    top_k: int = 40              # <= 0 disables
    top_p: float = 0.95          # >= 1 disables
    min_p: float = 0.05          # <= 0 disables
    repeat_penalty: float = 1.0  # 1 disables
    repeat_last_n: int = 64      # 0 disables, -1 means the whole history
    seed: int | None = None
    presence_penalty: float = 0.0   # OpenAI's, over the answer's tokens (0 disables)
    frequency_penalty: float = 0.0  # OpenAI's, over the answer's tokens (0 disables)
    banned: tuple[int, ...] = ()  # never drawn (llama.cpp's --ignore-eos: the end-of-generation
                                  # tokens' logits -inf)

    def validate(self) -> "SamplerParams":
        if not 0.0 < self.top_p <= 1.0:
            raise SamplerError(f"top_p={self.top_p} must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplerError(f"min_p={self.min_p} must be in [0, 1]")
        if self.repeat_penalty <= 0.0:
            raise SamplerError(f"repeat_penalty={self.repeat_penalty} must be positive")
        if self.repeat_last_n < -1:
            raise SamplerError(f"repeat_last_n={self.repeat_last_n} must be -1, 0 or positive")
        return self


def apply_repeat_penalty(logits: np.ndarray, recent: np.ndarray, penalty: float) -> np.ndarray:
    """Penalize each distinct recent token once: positive logits / penalty, negative × penalty.
    logits (vocab,) is not modified; returns a copy."""
    out = logits.astype(np.float32, copy=True)          # (vocab,)
    ids = np.unique(recent)                             # (n_distinct,)
    vals = out[ids]                                     # (n_distinct,)
    out[ids] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def apply_presence_frequency(logits: np.ndarray, made: np.ndarray, presence: float,
                             frequency: float) -> np.ndarray:
    """OpenAI's penalties: logit[j] - count[j] * frequency - (count[j] > 0) * presence, count[j]
    how often token j is in made (n,). logits (vocab,) is not modified; returns a copy."""
    out = logits.astype(np.float32, copy=True)          # (vocab,)
    ids, counts = np.unique(made, return_counts=True)   # (n_distinct,), (n_distinct,)
    keep = ids < len(out)
    ids, counts = ids[keep], counts[keep]
    out[ids] -= (counts * frequency + presence).astype(np.float32)
    return out


def top_k(ids: np.ndarray, logits: np.ndarray, k: int):
    """The k candidates with the largest logits, sorted descending, ties in index order (all,
    sorted, when k <= 0). With k set, only the k are sorted: a partition finds the k-th largest
    value first (a whole-vocabulary sort is slow at 152k tokens: docs/MEASUREMENTS.md)."""
    if not 0 < k < len(logits):
        order = np.argsort(-logits, kind="stable")      # (n,)
        return ids[order], logits[order]
    kth = np.partition(logits, len(logits) - k)[len(logits) - k]     # the k-th largest value
    above = np.flatnonzero(logits > kth)                             # (< k,)
    tied = np.flatnonzero(logits == kth)[:k - len(above)]            # the lowest ids first
    keep = np.concatenate([above, tied])                             # (k,)
    order = keep[np.argsort(-logits[keep], kind="stable")]           # (k,) as the full sort
    return ids[order], logits[order]


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits.astype(np.float64) - logits.max())  # (n,)
    return e / e.sum()


def top_p(ids: np.ndarray, logits: np.ndarray, p: float):
    """Keep the shortest prefix (candidates sorted descending) whose probability mass reaches p."""
    if p >= 1.0:
        return ids, logits
    cum = np.cumsum(softmax(logits))                    # (n,)
    keep = int(np.searchsorted(cum, p)) + 1
    return ids[:keep], logits[:keep]


def min_p(ids: np.ndarray, logits: np.ndarray, p: float):
    """Keep candidates whose probability is at least p × the top probability."""
    if p <= 0.0:
        return ids, logits
    keep = logits >= logits.max() + np.log(p)           # (n,) bool
    return ids[keep], logits[keep]


class Sampler:
    """Stateful only through its random generator: sample(logits, history) -> token id."""

    def __init__(self, params: SamplerParams):
        self.params = params.validate()
        self.rng = np.random.default_rng(params.seed)
        self.made_from = 0                  # history index where the answer starts (begin)

    def begin(self, n_context: int) -> None:
        """A new text starts after the first n_context tokens of the history (a constrained
        sampler's grammar starts there: generation/constrain.py; the presence and frequency
        penalties count the tokens from there)."""
        self.made_from = n_context

    def finished(self, history: Sequence[int]) -> bool:
        """Whether nothing but the end may follow history (a complete grammar); never here."""
        return False

    def accepting(self, history: Optional[Sequence[int]] = None) -> bool:
        """Whether history (None: what the sampler last saw) may end here as far as a grammar
        goes (always, without one)."""
        return True

    def rows_allowed(self, history: Sequence[int], guesses: Sequence[int],
                     siblings: dict) -> Optional[list]:
        """The tokens each row of a decode pass may take ((vocab,) bool masks, Model.forward's
        allowed), or None: any (no grammar)."""
        return None

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """logits (vocab,) of the next token; history: the token ids so far (prompt included)."""
        ids, probs = self.distribution(logits, history)  # (n,), (n,)
        if len(ids) == 1:
            return int(ids[0])
        return int(ids[self.rng.choice(len(ids), p=probs)])

    def sample_given(self, logits: np.ndarray, history: Sequence[int], guess: int) -> int:
        """A token distributed exactly as sample(logits, history) draws it, kept equal to guess
        as often as possible: guess with the probability p(guess), else a draw from p without
        guess (speculative sampling with a one-point draft). Greedy: guess iff it is the argmax."""
        ids, probs = self.distribution(logits, history)  # (n,), (n,)
        hit = ids == guess                              # (n,) bool
        p_guess = float(probs[hit].sum())
        if p_guess >= 1.0 or (p_guess > 0.0 and self.rng.random() < p_guess):
            return int(guess)
        rest = np.where(hit, 0.0, probs)                # (n,)
        if len(ids) == 1:
            return int(ids[0])
        return int(ids[self.rng.choice(len(ids), p=rest / rest.sum())])

    def mode(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """The most likely token the chain leaves: the penalized argmax (greedy's token)."""
        return int(np.argmax(self._penalized(logits, history)))

    def modes(self, logits: np.ndarray, history: Sequence[int] = ()) -> tuple[int, int]:
        """The two most likely tokens the chain leaves: mode's, then the next (penalized)."""
        pen = np.array(self._penalized(logits, history), dtype=np.float32)  # (vocab,) a copy
        first = int(np.argmax(pen))
        pen[first] = -np.inf
        return first, int(np.argmax(pen))

    def distribution(self, logits: np.ndarray, history: Sequence[int] = ()):
        """The candidates left by the chain and their probabilities: (ids (n,), probs (n,)).
        Greedy (temp <= 0) leaves one candidate with probability 1."""
        logits = self._penalized(logits, history)       # (vocab,)
        return self.chain(np.arange(len(logits)), logits)

    def chain(self, ids: np.ndarray, logits: np.ndarray):
        """The chain after the penalties over candidates ids (n,) with their logits (n,):
        (ids (k,), probs (k,)); greedy: the argmax alone (the first of ties)."""
        prm = self.params
        if prm.temp <= 0.0:
            return np.array([int(ids[np.argmax(logits)])]), np.ones(1)
        ids, cand = top_k(ids, logits, prm.top_k)       # (n,), (n,) sorted descending
        ids, cand = top_p(ids, cand, prm.top_p)
        ids, cand = min_p(ids, cand, prm.min_p)
        return ids, softmax(cand.astype(np.float64) / prm.temp)   # (k,): a huge temp stays finite

    def _penalized(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """logits (vocab,) as f32, the banned tokens' -inf and the repeat penalty of history
        applied (a copy if so)."""
        logits = np.asarray(logits, dtype=np.float32)   # (vocab,)
        if self.params.banned:
            logits = logits.copy()
            logits[list(self.params.banned)] = -np.inf
        recent = self._recent(history)                  # (n_recent,)
        if self.params.repeat_penalty != 1.0 and len(recent):
            logits = apply_repeat_penalty(logits, recent, self.params.repeat_penalty)
        prm = self.params
        if (prm.presence_penalty or prm.frequency_penalty) and len(history) > self.made_from:
            made = np.asarray(history[self.made_from:], dtype=np.int64)    # (n_made,)
            logits = apply_presence_frequency(logits, made, prm.presence_penalty,
                                              prm.frequency_penalty)
        return logits

    def penalized(self, logits: np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        """The logits (vocab,) the chain starts from: the penalties applied, banned tokens and
        (a constrained sampler's) tokens a grammar forbids at -inf; before top-k / top-p /
        min-p and the temperature."""
        return self._penalized(logits, history)

    def _recent(self, history: Sequence[int]) -> np.ndarray:
        n = self.params.repeat_last_n
        hist = np.asarray(history, dtype=np.int64)      # (n_hist,)
        if n == 0:
            return hist[:0]
        return hist if n < 0 else hist[-n:]
