"""Generation as small verbs: prefill the prompt, a decode pass (the fed token and any draft
guesses, flashllm/generation/speculate.py), and the loop that joins them to the sampler, with llama.cpp-style
timings."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from flashllm.generation.speculate import Draft, Guesses, verify_tree


@dataclass
class GenStats:
    n_prompt: int = 0      # prompt tokens evaluated by prefill
    n_gen: int = 0         # tokens generated (emitted; a stop token is not counted)
    n_decode: int = 0      # decode forward passes (one fed token, plus any draft guesses)
    n_drafted: int = 0     # draft guesses checked by those passes
    n_accepted: int = 0    # guesses kept: each is a token made without a pass of its own
    n_siblings: int = 0    # siblings checked (a guess's runner-up, speculate.Guesses)
    n_sibling_kept: int = 0  # of them taken where their guess was not
    prefill_s: float = 0.0
    decode_s: float = 0.0  # decode forward passes (and the drafting of their guesses)
    draft_s: float = 0.0   # of it, drafting guesses (a self-speculative draft computes them)
    sample_s: float = 0.0  # sampler calls
    stopped: bool = False  # ended on a stop token (or a complete grammar: Sampler.finished)

    @staticmethod
    def _line(label: str, seconds: float, n: int, unit: str) -> str:
        ms = seconds * 1e3
        per = ms / n if n else 0.0
        rate = n / seconds if seconds > 0 else 0.0
        return (f"{label} = {ms:10.2f} ms / {n:5d} {unit} ({per:8.2f} ms per token, "
                f"{rate:8.2f} tokens per second)")

    def summary(self) -> str:
        """The lines llama.cpp prints: sampling, prompt eval and eval (decode) speeds, the eval
        line counting the tokens the decode passes made (a pass that keeps draft guesses makes
        more than one: the draft line counts the passes)."""
        return "\n".join([self._line("   sampling time", self.sample_s, self.n_gen + self.stopped, "runs  "),
                          self._line("prompt eval time", self.prefill_s, self.n_prompt, "tokens"),
                          self._line("       eval time", self.decode_s, self.n_made, "runs  ")]
                         + ([self.draft_line()] if self.n_drafted else []))

    @property
    def n_made(self) -> int:
        """Tokens the decode passes made: one a pass, and each guess a pass kept."""
        return self.n_decode + self.n_accepted

    def draft_line(self) -> str:
        kept = self.n_accepted / self.n_drafted if self.n_drafted else 0.0
        per = (self.n_decode + self.n_accepted) / self.n_decode if self.n_decode else 0.0
        sib = f", {self.n_sibling_kept} of {self.n_siblings} siblings taken" \
            if self.n_siblings else ""
        return (f"           draft = {self.n_drafted:5d} guessed, {self.n_accepted:5d} kept "
                f"({100 * kept:.0f}%){sib}, {self.n_decode} passes, {per:.2f} tokens a pass, "
                f"{self.draft_s * 1e3:.2f} ms drafting")

    @property
    def prefill_tps(self) -> float:
        return self.n_prompt / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Tokens the decode passes made per second (a pass makes 1 + its kept guesses)."""
        return self.n_made / self.decode_s if self.decode_s > 0 else 0.0


Progress = Callable[[int, int], None]      # (layers done, n_layers) of a prefill


def prefill(model, ids: Sequence[int], pos0: int = 0,
            progress: Optional[Progress] = None, allowed: Optional[list] = None) -> np.ndarray:
    """Run the prompt ids (T,) at positions pos0..; the next-token logits (vocab,).
    progress(layers done, n_layers) after each layer, when given; allowed: a grammar's mask of
    the next token ([(vocab,) bool], Model.forward's), when there is one."""
    tokens = np.asarray(ids, dtype=np.int32)                                       # (T,)
    more = {} if allowed is None else {"allowed": allowed}      # scripted models take none
    return model.forward(tokens, pos0, last_only=True, progress=progress, **more)[0]  # (vocab,)


def generate(model, sampler, prompt_ids: Sequence[int], n_predict: int,
             stop_ids: Iterable[int] = (), on_token: Optional[Callable[[int], None]] = None,
             pos0: int = 0, draft: Optional[Draft] = None,
             on_prefill: Optional[Progress] = None) -> GenStats:
    """Prefill prompt_ids at pos0, then sample up to n_predict tokens (n_predict < 0: until a
    stop token or the context is full). Each emitted token goes to on_token; a stop token ends
    the loop without being emitted, as does a sampler's complete grammar (Sampler.finished:
    nothing but the end may follow, so no pass runs for it). With a draft (speculate.NgramDraft), each pass also checks
    the draft's guesses and may yield several tokens, distributed as without it. on_prefill:
    prefill's progress."""
    stops = set(int(t) for t in stop_ids)
    history = [int(t) for t in prompt_ids]
    stats = GenStats(n_prompt=len(history))
    clock = time.perf_counter
    t0 = clock()
    sampler.begin(len(history))
    allowed = sampler.rows_allowed(history, [], {})         # a grammar's first mask, or None
    logits = prefill(model, history, pos0, on_prefill, allowed)   # (vocab,)
    stats.prefill_s = clock() - t0
    pos = pos0 + len(history)                               # where the next fed token goes
    limit = n_predict if n_predict >= 0 else model.n_ctx - pos + 1
    if limit <= 0:
        return stats
    t0 = clock()
    new = [sampler.sample(logits, history)]
    stats.sample_s += clock() - t0
    while True:
        for token in new:
            if token in stops:
                stats.stopped = True
                return stats
            history.append(token)
            stats.n_gen += 1
            if on_token is not None:
                on_token(token)
            if sampler.finished(history):        # a complete grammar: only the end may follow
                stats.stopped = True
                return stats
            if stats.n_gen == limit:
                return stats
        if pos >= model.n_ctx:
            return stats
        room = min(limit - stats.n_gen - 1, model.n_ctx - pos - 1)
        t0 = clock()
        new, n_guesses, forward_s, draft_s, sib = decode_pass(model, sampler, draft, history, pos,
                                                              room)
        stats.n_siblings += sib[0]
        stats.n_sibling_kept += sib[1]
        stats.sample_s += clock() - t0 - forward_s
        stats.decode_s += forward_s
        stats.draft_s += draft_s
        stats.n_decode += 1
        stats.n_drafted += n_guesses
        stats.n_accepted += len(new) - 1
        pos += len(new)


def decode_pass(model, sampler, draft: Optional[Draft], history: list, pos: int, room: int):
    """Feed history's last token at pos with up to room draft guesses (draft None: none).

    Returns (tokens, n_guesses, seconds, draft seconds, (siblings, kept)): the tokens the pass
    yields (the guesses kept, then one more), ready to emit; the seconds of the drafting and the
    forward pass, and of the drafting alone; the siblings checked and whether one was taken.
    Keys/values stay valid for the fed token and the kept guesses (positions pos .. pos +
    len(tokens) - 1; a taken sibling's among them); the last token is not fed yet."""
    t0 = time.perf_counter()
    guesses = draft.propose(history, room, pos) if draft is not None else Guesses()
    sib = guesses.siblings                                # {guess index: token}
    t1 = time.perf_counter()
    order = sorted(sib)
    tokens = np.array(history[-1:] + list(guesses) + [sib[j] for j in order], dtype=np.int32)
    allowed = sampler.rows_allowed(history, guesses, sib)   # None, or a grammar's mask a row
    more = {} if allowed is None else {"allowed": allowed}
    rows = model.forward(tokens, pos, siblings=[1 + j for j in order], **more)
    # rows (1 + k + S, vocab): after the fed token, each guess, each sibling
    seconds = time.perf_counter() - t0
    new, kept = verify_tree(sampler, rows, guesses, sib, history)
    if kept is not None:                  # the sibling of guess j stands at pos + 1 + j
        model.keep_sibling(kept, pos + 1 + order[kept])
    sib_seen = (len(sib), int(kept is not None))
    if draft is not None:
        draft.observe(len(guesses), len(new) - 1, seconds, sib_seen, t1 - t0)
    return new, len(guesses), seconds, t1 - t0, sib_seen
