"""Byte sizes: binary units, the direct-I/O page, and the one parser and formatter of sizes."""
from __future__ import annotations

from flashllm.errors import FlashError

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
PAGE = 4096          # direct I/O: file offsets, read lengths and buffers are multiples of this

_UNITS = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


class SizeError(FlashError):
    """A size the user typed that is not one."""


def parse_size(text: str) -> int:
    """Bytes of '2GiB', '512MiB', '1.5G', '4096' (binary units, B optional)."""
    units = {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": TiB}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in units else ""
    try:
        value = float(t[:len(t) - len(unit)])
    except ValueError:
        raise SizeError(f"cannot read {text!r} as a size (e.g. 2GiB, 512MiB)") from None
    if not 0 < value < float("inf"):
        raise SizeError(f"size {text!r} must be positive")
    return int(value * units[unit])


def format_size(n: int | float, unit: str | None = None, up: bool | None = None) -> str:
    """Bytes for people. Without `unit`: the largest binary unit that fits, a whole number when
    exact ('256 KiB'), else one decimal ('1.5 GiB'). With `unit` ('MiB') and `up`: whole units
    rounded up (what something needs) or down (what a budget gives): '230 MiB'."""
    if unit is not None:
        size = dict(_UNITS)[unit]
        whole = -(-int(n) // size) if up else int(n) // size
        return f"{whole} {unit}"
    for name, size in _UNITS:
        if n >= size:
            return f"{n // size} {name}" if n % size == 0 else f"{n / size:.1f} {name}"
    return f"{int(n)} B"
