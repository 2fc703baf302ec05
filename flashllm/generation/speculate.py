"""Speculative decoding with drafts looked up in the context (no draft model).

Under a DRAM budget a forward pass over T tokens streams the same FFN bundles as a pass over one,
so checking k guessed tokens costs little more than making one token. The guesses come from the
text itself (prompt lookup decoding, as llama.cpp's `lookup` example and transformers'
`prompt_lookup_num_tokens`): the longest n-gram that ends the context is found at its latest
earlier occurrence, and the tokens that followed it there are proposed. Code, edits and quotes
repeat their context often.

Verification keeps the output what plain decoding would produce: each guess is passed through
Sampler.sample_given, which returns the guess with the probability the sampler gives it and
otherwise a token drawn from the rest (speculative sampling with a one-point draft, Leviathan et
al. 2023); greedy keeps a guess only when it is the argmax. The first rejected position yields
the corrected token, and when every guess is kept the pass's last row yields one token more.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from flashllm.errors import FlashError


class DraftError(FlashError):
    """Draft settings that make no sense."""


class DraftLength:
    """How many guesses a pass should check: the k that makes the most tokens per second.

    With a share `a` of the guesses kept (each one reached only if the ones before it were kept),
    a pass over k guesses makes 1 + a + ... + a^k tokens and costs c1 + k·ce seconds. `a` is
    learned from the guesses each pass reached and kept (decayed counts); c1 and ce by a decayed
    least-squares line through the passes' (guesses, seconds), so the passes' own spread of k
    (drafting stops early when the draft doubts) tells a plain pass's time from a guess's, and
    no pass need go without guesses to measure it. Until MIN_FIT passes with guesses are seen,
    a guess is taken to cost PRIOR_RATIO of a pass (the first passes carry warm-up costs). Under
    a DRAM budget a pass is mostly the FFN's reads and a guess adds only its compute (~10-15% of a
    pass on the 1.5B at 280-560 MiB), so k runs high; with all weights in DRAM a guess costs ~a
    third of a pass and only a context that repeats pays. When k = 0 wins, every EXPLORE-th pass
    still checks one guess, so a context that starts repeating is noticed. With `refresh` r (a
    draft that always has guesses), the first pass checks none, and so does the r-th pass after
    the last one without guesses while the guesses' counts vary too little to fit the line.
    """

    DECAY, EXPLORE = 0.9, 4
    FIT_DECAY = 0.95         # the line's memory: ~20 passes
    SPREAD_MIN = 0.2         # decayed variance of k the line needs
    MIN_FIT = 4              # passes with guesses before the line is trusted
    PRIOR_RATIO = 0.25       # ce / c1 before that

    def __init__(self, n_max: int, refresh: int = 0):
        self.n_max, self.refresh = n_max, refresh
        self.kept, self.reached = 2.0, 4.0          # decayed guess counts (prior a = 0.5: two
                                                    # early misses do not turn guessing off)
        self.c1: float | None = None                # seconds of a pass without guesses
        self.ce: float | None = None                # extra seconds per guess
        self.line = DecayedLine(self.FIT_DECAY, self.SPREAD_MIN)    # seconds against k
        self._idle = 0                              # passes since the last guess
        self._busy = 0                              # passes since the last one without
        self._ne = 0                                # passes with guesses observed

    @property
    def rate(self) -> float:
        return self.kept / self.reached

    def choose(self) -> int:
        if self.refresh and self.n_max and (
                self.c1 is None or (self._busy >= self.refresh and not self.line.fitted)):
            self._busy = 0
            return 0
        k = self._best()
        self._busy = self._busy + 1 if k else 0
        return k

    def _best(self) -> int:
        a = min(self.rate, 0.999)
        ratio = self.ce / self.c1 if self.c1 and self.ce is not None else self.PRIOR_RATIO
        best = max(range(self.n_max + 1),
                   key=lambda k: (1 - a ** (k + 1)) / (1 - a) / (1 + max(ratio, 1e-3) * k))
        if best == 0:
            self._idle += 1
            return 1 if self._idle % self.EXPLORE == 0 and self.n_max else 0
        self._idle = 0
        return best

    def observe(self, n_guesses: int, n_kept: int, seconds: float) -> None:
        """A pass checked n_guesses, kept n_kept of them, and took seconds."""
        self.line.add(n_guesses, seconds)
        if n_guesses:
            self._ne += 1
            self.kept = self.DECAY * self.kept + n_kept
            self.reached = self.DECAY * self.reached + min(n_kept + 1, n_guesses)
        self._fit(n_guesses == 0, seconds)

    def _fit(self, plain: bool, seconds: float) -> None:
        """c1, ce from the line through the passes (none before MIN_FIT passes with guesses);
        while the line cannot be fitted, c1 follows the plain passes' time and ce is what the
        passes took beyond it, per guess."""
        if self._ne < self.MIN_FIT:
            if plain:
                self.c1 = seconds if self.c1 is None else 0.5 * (self.c1 + seconds)
            return
        if self.line.fitted:
            ce = max(self.line.slope, 0.0)
            c1 = self.line.mean_y - ce * self.line.mean_x
            if c1 > 0:
                self.c1, self.ce = c1, ce
                return
        if plain:
            self.c1 = seconds if self.c1 is None else \
                self.c1 + (1 - self.DECAY) * (seconds - self.c1)
        elif self.c1 is not None and self.line.mean_x > 0:
            self.ce = max((self.line.mean_y - self.c1) / self.line.mean_x, 0.0)


class DecayedLine:
    """A least-squares line y = a + b·x through points whose weight decays by `decay` with each
    new one (~1 / (1 - decay) points remembered); fitted once the x's decayed variance reaches
    spread_min (before that the slope cannot be told from the noise)."""

    def __init__(self, decay: float, spread_min: float):
        self.decay, self.spread_min = decay, spread_min
        self._sums = np.zeros(5)                    # decayed [1, x, x², y, x·y]

    def add(self, x: float, y: float) -> None:
        x = float(x)
        self._sums = self.decay * self._sums + np.array([1.0, x, x * x, y, x * y])

    @property
    def mean_x(self) -> float:
        return self._sums[1] / self._sums[0] if self._sums[0] > 0 else 0.0

    @property
    def mean_y(self) -> float:
        return self._sums[3] / self._sums[0] if self._sums[0] > 0 else 0.0

    def _var_x(self) -> float:
        w, sx, sxx = self._sums[:3]
        return sxx / w - (sx / w) ** 2 if w > 0 else 0.0

    @property
    def fitted(self) -> bool:
        return self._sums[0] > 0 and self._var_x() >= self.spread_min

    @property
    def slope(self) -> float:
        """b (0 while not fitted)."""
        if not self.fitted:
            return 0.0
        w, sx, _, sy, sxy = self._sums
        return (sxy / w - sx / w * sy / w) / self._var_x()


class Draft(Protocol):
    """What generation asks of a draft (NgramDraft; self_draft.SelfDraft)."""

    def propose(self, history: Sequence[int], room: int, pos: int = 0) -> Guesses:
        """Up to room guesses for the positions after history, whose last token is fed at pos."""
        ...

    def observe(self, n_guesses: int, n_kept: int, seconds: float,
                siblings: tuple[int, int] = (0, 0), drafting: float = 0.0) -> None:
        """After a pass: its guesses, the tokens it kept past the first, its seconds (drafting
        included), (siblings checked, taken), the drafting's seconds."""
        ...


class NgramDraft(Draft):
    """Guesses the next tokens by looking the context's last n-gram up earlier in the context.

    propose(history, room) -> up to room token ids, as many as DraftLength finds worth checking;
    observe(guesses, kept, seconds) after each pass. The index of n-grams grows with the history
    it is shown; a history that is not an extension of the last one rebuilds it.
    """

    def __init__(self, n_draft: int, max_ngram: int = 3, min_ngram: int = 1):
        if n_draft < 0:
            raise DraftError(f"--draft {n_draft} must be 0 (off) or positive")
        if not 1 <= min_ngram <= max_ngram:
            raise DraftError(f"n-gram sizes {min_ngram}..{max_ngram}: need 1 <= min <= max")
        self.n_draft, self.min_n, self.max_n = n_draft, min_ngram, max_ngram
        self.length = DraftLength(n_draft)
        self._seen: list[int] = []   # the history indexed so far
        # _after[n][ngram] = index of the token after the ngram's latest occurrence
        self._after: list[dict] = [{} for _ in range(max_ngram + 1)]

    def observe(self, n_guesses: int, n_kept: int, seconds: float, siblings=(0, 0),
                drafting: float = 0.0) -> None:
        self.length.observe(n_guesses, n_kept, seconds)

    def propose(self, history: Sequence[int], room: int, pos: int = 0) -> Guesses:
        """Up to min(room, the chosen length) tokens that followed the longest n-gram ending
        history (none when nothing matches); pos (where history's last token is fed) unused."""
        return Guesses(self.lookup(history, min(room, self.length.choose())))

    def lookup(self, history: Sequence[int], k: int, tail: Sequence[int] = ()) -> list[int]:
        """Up to k tokens after the latest earlier occurrence of the longest final n-gram of
        history + tail (history is indexed first, from where the last call left; tail is not)."""
        self._index(history)
        if k <= 0:
            return []
        text = list(history[-self.max_n:]) + [int(t) for t in tail]
        for n in range(min(self.max_n, len(history) + len(tail) - 1), self.min_n - 1, -1):
            start = self._after[n].get(tuple(text[len(text) - n:]))
            if start is not None:
                return [int(t) for t in history[start:start + k]]
        return []

    def _index(self, history: Sequence[int]) -> None:
        """Index every n-gram of history followed by a token (the last one has no successor)."""
        done = len(self._seen)
        if done > len(history) or list(history[:done]) != self._seen:
            self._seen, self._after = [], [{} for _ in range(self.max_n + 1)]
            done = 0
        self._seen.extend(int(t) for t in history[done:])
        seen = self._seen
        for i in range(max(done, 1), len(seen)):       # the n-grams ending just before token i
            for n in range(self.min_n, min(self.max_n, i) + 1):
                self._after[n][tuple(seen[i - n:i])] = i


class Guesses(list):
    """A draft's guesses (a list of token ids), and for some of them a sibling: siblings[j] is
    the token the draft ranked next after guess j, checked in the same pass in case the model
    takes it instead (Model.forward's siblings; a tree of one chain and leaves)."""

    def __init__(self, tokens=(), siblings: dict | None = None):
        super().__init__(tokens)
        self.siblings: dict[int, int] = dict(siblings or {})

    @property
    def rows(self) -> int:
        """The rows they add to a pass: every guess and every sibling."""
        return len(self) + len(self.siblings)

    def cut(self, n: int) -> "Guesses":
        """These guesses in at most n rows: the first guesses, then the siblings of the ones
        kept, first guess first."""
        kept = Guesses(self[:max(n, 0)])
        for j in sorted(self.siblings):
            if j < len(kept) and kept.rows < n:
                kept.siblings[j] = self.siblings[j]
        return kept


def verify(sampler, rows: np.ndarray, guesses: Sequence[int], history: Sequence[int]) -> list[int]:
    """The tokens a pass over [fed token] + guesses yields: the guesses kept, then one more.

    rows (1 + k, vocab): logits after the fed token and after each guess; history ends with the
    fed token. Every returned token is distributed as sampler.sample would draw it there.
    """
    return verify_tree(sampler, rows, guesses, {}, history)[0]


def verify_tree(sampler, rows: np.ndarray, guesses: Sequence[int], siblings: dict,
                history: Sequence[int]) -> tuple[list[int], int | None]:
    """verify, with siblings {j: token} checked where guess j is not kept: rows (1 + k + S,
    vocab), the S sibling rows last in the order of sorted j. Returns the tokens and the index
    of the sibling kept (None: none). The token drawn where guess j fails is distributed as
    without siblings (sample_given); when it is guess j's sibling, the sibling's row yields one
    token more."""
    context = list(history)
    out: list[int] = []
    row_of = {j: len(guesses) + 1 + s for s, j in enumerate(sorted(siblings))}
    for j, guess in enumerate(guesses):
        token = sampler.sample_given(rows[j], context, int(guess))
        out.append(token)
        context.append(token)
        if token == guess:
            continue
        if j in siblings and token == siblings[j]:
            out.append(sampler.sample(rows[row_of[j]], context))
            return out, row_of[j] - len(guesses) - 1
        return out, None
    out.append(sampler.sample(rows[len(guesses)], context))
    return out, None
