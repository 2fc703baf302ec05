"""What the tokenizer holds on the run path, as budget.py counts it: anonymous resident memory
(/proc/self/status RssAnon, heap trimmed) over the process before the model was opened.

Run:  python -m scripts.studies.tokenizer_rss MODEL_FOLDER [PROMPT_FILE] [--chat]

One-shot (the default) does what `flashllm run -p` does under --dram-budget: load without the
word cache, encode the prompt, release(keep_source=False). --chat keeps the tokenizer loaded and
encodes the prompt 20 times, as turns of a chat would. Prints MiB and the ratio to the JSON's
bytes, and the peak (VmHWM, reset through /proc/self/clear_refs just before) over the process
while the tokenizer loads, with the form of its merges (the manifest's tokenizer "merges").
"""
from __future__ import annotations

import ctypes
import gc
import sys
from pathlib import Path

PROMPT = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 20
MiB = 2 ** 20


def status(key: str) -> int:
    """Bytes of a kB field of /proc/self/status."""
    line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def anon() -> int:
    """RssAnon once the garbage and the heap's free pages are gone."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return status("RssAnon")


def main(args: list[str]) -> None:
    from flashllm.format.reader import open_flash
    from flashllm.generation.tokenizer import Tokenizer
    chat = "--chat" in args
    args = [a for a in args if a != "--chat"]
    folder = Path(args[0])
    prompt = Path(args[1]).read_text(encoding="utf-8") if len(args) > 1 else PROMPT
    json_bytes = (folder / "tokenizer.json").stat().st_size
    base = anon()
    flash = open_flash(folder)
    opened = anon()
    Path("/proc/self/clear_refs").write_text("5")          # VmHWM := VmRSS
    rss = status("VmRSS")
    tok = Tokenizer.from_flash(flash, word_cache=chat)
    peak = status("VmHWM") - rss
    for _ in range(20 if chat else 1):
        n = len(tok.encode(prompt))
    if not chat:
        tok.release(keep_source=False)
    held = anon() - opened
    what = "loaded (chat)" if chat else "released (one-shot)" if tok.releasable else "kept"
    table = f"{tok.table.nbytes / MiB:.2f} MiB" if tok.table is not None else "none"
    merges = flash.manifest["tokenizer"].get("merges", "unrecorded")
    print(f"{folder.name}: tokenizer.json {json_bytes / MiB:.2f} MiB (merges: {merges}), byte "
          f"table {table}, prompt {n} tokens; {what}: {held / MiB:.2f} MiB "
          f"= {held / json_bytes:.2f}x the JSON (open_flash alone {(opened - base) / MiB:.2f} "
          f"MiB); peak while loading {peak / MiB:.1f} MiB = {peak / json_bytes:.1f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
