"""The small files of a flash model folder being written (format/writer.py): tokenizer.json —
a text, or streamed by an object that puts its bytes (gguf_vocab.GGUFVocab: never held as one
text) — and the neuron order, each written into the writer's temporary folder and fsync'd, with
its manifest entry (file, nbytes, crc32)."""
from __future__ import annotations

import zlib
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from flashllm.errors import FormatError
from flashllm.format.files import sync_close, why
from flashllm.format.layout import ORDER_FILE, TOKENIZER_FILE

Put = Callable[[bytes], None]


def stream_file(folder: Path, name: str, stream: Callable[[Put], None]) -> dict:
    """folder/name, whose bytes stream(put) puts, fsync'd; its manifest entry."""
    sums = [0, 0]                                      # bytes written, their crc32
    path = folder / name
    try:
        f = open(path, "wb")
    except OSError as e:
        raise FormatError(f"cannot write {path}: {why(e)}") from None

    def put(data: bytes) -> None:
        f.write(data)
        sums[:] = sums[0] + len(data), zlib.crc32(data, sums[1])
    try:
        stream(put)
        sync_close(f)
    except OSError as e:
        raise FormatError(f"cannot write {f.name}: {why(e)}") from None
    return {"file": name, "nbytes": sums[0], "crc32": sums[1]}


def write_file(folder: Path, name: str, data: bytes) -> dict:
    """folder/name holding data, fsync'd; its manifest entry."""
    return stream_file(folder, name, lambda put: put(data))


def write_order(folder: Path, orders: list, n_slots: int) -> Optional[dict]:
    """The neuron order file of every layer's order (n_slots,) (None: the identity), its
    manifest entry; None (no file) when no layer has one."""
    if all(o is None for o in orders):
        return None
    identity = np.arange(n_slots)                                             # (n_slots,)
    table = np.stack([identity if o is None else o for o in orders])          # (n_layers, n_slots)
    table = table.astype("<i4")
    return {**write_file(folder, ORDER_FILE, table.tobytes()), "dtype": "int32",
            "shape": list(table.shape)}


class TokenizerFile:
    """The folder's tokenizer: set() streams a streamed one at once (it is never held), entry()
    writes a text one when the folder is finished and gives the manifest's `tokenizer` section."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.text: Optional[str] = None
        self.written: Optional[dict] = None      # its manifest entry, when streamed already
        self.chat_template: Optional[str] = None
        self.merges: Optional[str] = None

    def set(self, tokenizer_json, chat_template: Optional[str], merges: Optional[str]) -> None:
        """tokenizer_json: the text, or an object whose write(put) streams it (written now);
        merges: the form of the JSON's BPE merges (layout.MERGES_FORMS), or None."""
        self.text, self.chat_template, self.merges = tokenizer_json, chat_template, merges
        self.written = None
        if not isinstance(tokenizer_json, (str, type(None))):
            self.written = stream_file(self.folder, TOKENIZER_FILE, tokenizer_json.write)
            self.text = None

    def entry(self) -> dict:
        """The manifest's `tokenizer` section, tokenizer.json written if it is a text."""
        entry = {"file": None, "chat_template": self.chat_template}
        if self.text is not None or self.written is not None:
            entry.update(self.written or
                         write_file(self.folder, TOKENIZER_FILE, self.text.encode("utf-8")))
            if self.merges is not None:
                entry["merges"] = self.merges
        return entry
