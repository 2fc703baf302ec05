"""Progress of long work on stderr, shown only once it has run a while: a line rewritten in
place on a terminal, else one line a quarter of the way (so logs keep a few lines, not hundreds)."""
from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO

QUIET_SECONDS = 2.0      # work that ends sooner shows nothing


def eta_progress(what: str, stream: Optional[TextIO] = None,
                 clock: Callable[[], float] = time.perf_counter) -> Callable[[int, int], None]:
    """progress(done, total) for `what` ("prefill of 4000 tokens") on stream (None: stderr):
    after QUIET_SECONDS, the share done and the time left; the terminal's line is cleared when
    done reaches total. progress(0, total) starts the clock again (the work starts now)."""
    stream = stream if stream is not None else sys.stderr
    t0, shown = [clock()], [-1]        # the start, the last quarter written off a terminal
    tty = stream.isatty()

    def progress(done: int, total: int) -> None:
        if done == 0:
            t0[0] = clock()
        spent = clock() - t0[0]
        if spent < QUIET_SECONDS or total <= 0:
            return
        left = spent / max(done, 1) * (total - done)
        line = f"{what}: {done}/{total} ({done / total:.0%}), about {left:.0f} s left"
        if tty:
            stream.write("\r\033[K" + (line if done < total else ""))
        elif done * 4 // total > shown[0] and done < total:
            shown[0] = done * 4 // total
            stream.write(line + "\n")
        stream.flush()
    return progress


def clear_line(stream: Optional[TextIO] = None) -> None:
    """On a terminal, clear the line eta_progress rewrites, so another message starts there."""
    stream = stream if stream is not None else sys.stderr
    if stream.isatty():
        stream.write("\r\033[K")
        stream.flush()
