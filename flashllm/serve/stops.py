"""Stop strings on streamed text: the text is released as soon as no stop string can begin in
it; a stop string found ends the text before it (OpenAI leaves the stop string out)."""
from __future__ import annotations


class StopText:
    """push(piece) -> (text safe to send, stopped); flush() -> what is held back at the end."""

    def __init__(self, stops: tuple):
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""

    def push(self, piece: str) -> tuple[str, bool]:
        self.pending += piece
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0),
                  default=-1)
        if cut >= 0:
            out, self.pending = self.pending[:cut], ""
            return out, True
        keep = self._held()
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[
            len(self.pending) - keep:]
        return out, False

    def _held(self) -> int:
        """How many trailing characters could still begin a stop string."""
        text = self.pending
        for n in range(min(self.hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
