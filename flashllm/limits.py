"""Bounds on what a file or a stream can make flashllm hold: its bytes read up to a limit (a
file of any size, /dev/zero or an endless pipe costs at most limit + 1 bytes to refuse), and
JSON whose nesting cannot exhaust Python's stack."""
from __future__ import annotations

import json
import os
from typing import BinaryIO, Optional, Union

Source = Union[str, "os.PathLike[str]", BinaryIO]


def read_capped(source: Source, limit: int) -> Optional[bytes]:
    """The bytes of source (a path, or a binary stream read to its end), or None when it holds
    more than limit bytes."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            return read_capped(f, limit)
    data = source.read(limit + 1)
    return None if len(data) > limit else data


def loads_json(data: Union[str, bytes]):
    """json.loads, nesting too deep for Python's stack (`[[[[…`: a RecursionError) raised as the
    ValueError every other malformed JSON is (json.JSONDecodeError is one)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
