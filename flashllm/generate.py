"""Generation as small verbs: prefill the prompt, decode one token, and the loop that joins them
to the sampler, with llama.cpp-style timings."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import numpy as np


@dataclass
class GenStats:
    n_prompt: int = 0      # prompt tokens evaluated by prefill
    n_gen: int = 0         # tokens generated (emitted; a stop token is not counted)
    n_decode: int = 0      # single-token forward passes
    prefill_s: float = 0.0
    decode_s: float = 0.0  # single-token forward passes
    sample_s: float = 0.0  # sampler calls
    stopped: bool = False  # ended on a stop token

    @staticmethod
    def _line(label: str, seconds: float, n: int, unit: str) -> str:
        ms = seconds * 1e3
        per = ms / n if n else 0.0
        rate = n / seconds if seconds > 0 else 0.0
        return (f"{label} = {ms:10.2f} ms / {n:5d} {unit} ({per:8.2f} ms per token, "
                f"{rate:8.2f} tokens per second)")

    def summary(self) -> str:
        """Two lines as llama.cpp prints them: prompt eval and eval (decode) speeds."""
        return "\n".join([self._line("   sampling time", self.sample_s, self.n_gen + self.stopped, "runs  "),
                          self._line("prompt eval time", self.prefill_s, self.n_prompt, "tokens"),
                          self._line("       eval time", self.decode_s, self.n_decode, "runs  ")])

    @property
    def prefill_tps(self) -> float:
        return self.n_prompt / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.n_decode / self.decode_s if self.decode_s > 0 else 0.0


def prefill(model, ids: Sequence[int], pos0: int = 0) -> np.ndarray:
    """Run the prompt ids (T,) at positions pos0..; the next-token logits (vocab,)."""
    return model.forward(np.asarray(ids, dtype=np.int32), pos0, last_only=True)[0]   # (vocab,)


def decode_one(model, token: int, pos: int) -> np.ndarray:
    """Run one token at position pos; the next-token logits (vocab,)."""
    return model.forward(np.array([token], dtype=np.int32), pos)[0]                   # (vocab,)


def generate(model, sampler, prompt_ids: Sequence[int], n_predict: int,
             stop_ids: Iterable[int] = (), on_token: Optional[Callable[[int], None]] = None,
             pos0: int = 0) -> GenStats:
    """Prefill prompt_ids at pos0, then sample up to n_predict tokens (n_predict < 0: until a
    stop token or the context is full). Each emitted token goes to on_token; a stop token ends
    the loop without being emitted."""
    stops = set(int(t) for t in stop_ids)
    history = [int(t) for t in prompt_ids]
    stats = GenStats(n_prompt=len(history))
    clock = time.perf_counter
    t0 = clock()
    logits = prefill(model, history, pos0)                  # (vocab,)
    stats.prefill_s = clock() - t0
    pos = pos0 + len(history)
    limit = n_predict if n_predict >= 0 else model.n_ctx - pos + 1
    while stats.n_gen < limit:
        t0 = clock()
        token = sampler.sample(logits, history)
        stats.sample_s += clock() - t0
        if token in stops:
            stats.stopped = True
            break
        history.append(token)
        stats.n_gen += 1
        if on_token is not None:
            on_token(token)
        if stats.n_gen == limit or pos >= model.n_ctx:
            break
        t0 = clock()
        logits = decode_one(model, token, pos)              # (vocab,)
        stats.decode_s += clock() - t0
        stats.n_decode += 1
        pos += 1
    return stats
