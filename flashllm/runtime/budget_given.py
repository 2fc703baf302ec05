"""A --dram-budget as the user gives it (parse_budget: bytes, or a percentage of the model) and
the refusals that name it: a budget below what must stay resident, or below the tokenizer's
load peak (runtime/budget.py plans the rest)."""
from __future__ import annotations

from dataclasses import dataclass

from flashllm.errors import FlashError
from flashllm.runtime.tokenizer_budget import older_conversion, tokenizer_load_peak
from flashllm.units import SizeError, format_size, parse_size


class BudgetError(FlashError):
    """A --dram-budget that cannot be read or cannot hold what must stay resident."""


@dataclass(frozen=True)
class Budget:
    """A --dram-budget, parsed once where it is given (parse_budget): bytes, or a percentage of
    the converted model's bytes; text is what the user wrote, for the messages that name it."""

    text: str
    nbytes: int = 0                   # bytes, when not a percentage
    percent: float = 0.0              # of the model's bytes, in (0, 100]; 0: nbytes

    @classmethod
    def of_bytes(cls, n: int) -> "Budget":
        return cls(str(n), nbytes=int(n))

    def bytes_of(self, model_bytes: int) -> int:
        """The budget in bytes for a model of model_bytes."""
        return int(model_bytes * self.percent / 100) if self.percent else self.nbytes


def parse_budget(text: str) -> Budget:
    """The Budget of '1.5GiB', '560MiB', '4096' or '50%' (of the converted model); BudgetError
    (one line) for anything else: empty, NaN, zero or negative, a percentage past 100."""
    t = text.strip()
    if t.endswith("%"):
        try:
            pct = float(t[:-1])
        except ValueError:
            pct = -1.0
        if not 0 < pct <= 100:
            raise BudgetError(f"--dram-budget {text!r}: a percentage must be in (0, 100]")
        return Budget(text, percent=pct)
    try:
        return Budget(text, nbytes=parse_size(t))
    except SizeError:
        raise BudgetError(f"--dram-budget {text!r} is not a size (e.g. 1.5GiB, 560MiB) or a "
                          f"percentage of the model (e.g. 50%)") from None


def check_tokenizer_load(manifest: dict, budget: int, text: str, process: int) -> None:
    """The tokenizers object peaks while it loads (before the model): it must fit then."""
    need = process + tokenizer_load_peak(manifest["tokenizer"])
    if budget < need:
        have, peak = format_size(budget, "MiB", up=False), format_size(need, "MiB", up=True)
        hint = "; this folder's converter wrote no merges form: converting its source again " \
            "(`flashllm convert ... --force`) may cut the tokenizer's peak by ~40%" \
            if older_conversion(manifest["tokenizer"]) else ""
        raise BudgetError(f"--dram-budget {text} ({have}) cannot load the tokenizer: the process "
                          f"and the tokenizer peak at {peak} while the prompt is encoded{hint}")


def refuse(budget: int, text: str, parts: dict, need: int) -> None:
    """BudgetError: budget (as the user wrote it: text) is below need, which parts make up."""
    mib = lambda n: format_size(n, "MiB", up=True)                  # noqa: E731
    listed = ", ".join(f"{k} {mib(v)}" for k, v in parts.items() if v)
    have = format_size(budget, "MiB", up=False)
    raise BudgetError(f"--dram-budget {text} ({have}) is below the {mib(need)} that must stay "
                      f"resident ({listed}); give at least {mib(need)}, or a shorter context "
                      f"(--ctx-size, or the prompt + --n-predict)")
