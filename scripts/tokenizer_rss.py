"""RSS of the tokenizer on the run path: loaded, after encoding a prompt, after release().

Run:  python scripts/tokenizer_rss.py MODEL_FOLDER
Prints MiB of resident memory (Linux /proc) at each step and the peak (VmHWM).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path


def rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def peak_mib() -> float:
    line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM"))
    return int(line.split()[1]) / 1024


def main() -> None:
    from flashllm.bundle import open_flash
    from flashllm.tokenizer import Tokenizer
    flash = open_flash(Path(sys.argv[1]))
    base = rss_mib()
    t0 = time.perf_counter()
    tok = Tokenizer.from_flash(flash)
    print(f"process + JSON text {base:.1f} MiB; tokenizer loaded {rss_mib():.1f} MiB "
          f"({time.perf_counter() - t0:.2f} s, byte table {tok.table.nbytes / 2**20:.1f} MiB)")
    ids = tok.encode("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 20)
    print(f"encoded {len(ids)} tokens: {rss_mib():.1f} MiB, peak {peak_mib():.1f} MiB")
    tok.release()
    text = tok.decode(ids)
    print(f"released: {rss_mib():.1f} MiB (+{rss_mib() - base:.1f} over the process); decode "
          f"without it: {text[:11]!r}")


if __name__ == "__main__":
    main()
