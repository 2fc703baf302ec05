"""The DRAM budget of a flash run: every resident byte accounted, the neuron caches sized from
what remains, and a one-line refusal before anything is loaded when the budget cannot work.

Resident at run time (all counted against --dram-budget):
    dense weights   dense.bin, read whole into DRAM by open_flash (embeddings, attention, norms)
    KV cache        2 · n_layers · n_ctx · n_kv_heads · head_dim · 4 bytes
    tokenizer       the `tokenizers` object: measured ~23-30× its tokenizer.json, counted as 32×
    process         the Python process before the model (interpreter, numpy, cffi): measured
    work            logits and activations of one forward pass, the reader's staging buffers,
                    the sparse FFN's staging buffer for prefill / streamed neurons
    predictor       its nbytes
    neuron caches   per layer (capacity, stride) rows + maps; the rest of the budget
Streaming the dense weights too (embedding rows looked up on flash, attention read per layer) is
not implemented: a budget below the dense weights is refused with that reason.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import FlashError
from .profile import MiB, ProfileError, parse_size

TOKENIZER_FACTOR = 32          # resident bytes of a loaded tokenizer per byte of tokenizer.json
STAGING_BYTES = 4 * MiB        # the sparse FFN's staging buffer (prefill chunks, streamed misses)
ROW_MAP_BYTES = 4 + 8          # per cache row: slot_of (int32) + last_use (int64)
WORK_FIXED = 8 * MiB           # activations, attention scratch, Python objects of a forward pass


class BudgetError(FlashError):
    """A --dram-budget that cannot be read or cannot hold what must stay resident."""


@dataclass(frozen=True)
class BudgetPlan:
    """What stays resident, and the per-layer neuron cache the rest of the budget buys."""

    budget: int                       # bytes
    resident: dict                    # what -> bytes, everything but the neuron caches
    n_layers: int
    n_ff: int
    stride: int
    capacity: int                     # cache rows per layer
    n_pinned: int                     # of them pinned (slots 0 .. n_pinned-1)
    staging_rows: int                 # rows of the staging buffer
    notes: tuple = field(default=())

    @property
    def cache_bytes(self) -> int:
        return self.n_layers * (self.capacity * (self.stride + ROW_MAP_BYTES) + 4 * self.n_ff)

    @property
    def total(self) -> int:
        return sum(self.resident.values()) + self.cache_bytes

    @property
    def cache_fraction(self) -> float:
        """Share of the FFN the caches hold."""
        return self.capacity / self.n_ff

    def summary(self) -> str:
        parts = ", ".join(f"{k} {mib(v)}" for k, v in self.resident.items())
        return (f"DRAM budget {mib(self.budget)}: {parts}; neuron caches {mib(self.cache_bytes)} "
                f"({self.capacity} of {self.n_ff} neurons per layer = {self.cache_fraction:.0%}, "
                f"{self.n_pinned} pinned)")


def mib(nbytes: int, up: bool = True) -> str:
    """Whole MiB, rounded up (a need) or down (what a budget gives): '230 MiB'."""
    n = -(-int(nbytes) // MiB) if up else int(nbytes) // MiB
    return f"{n} MiB"


def parse_budget(text: str, model_bytes: int) -> int:
    """Bytes of '1.5GiB', '560MiB', '4096' or '50%' (of model_bytes, the converted model)."""
    t = text.strip()
    if t.endswith("%"):
        try:
            pct = float(t[:-1])
        except ValueError:
            pct = -1.0
        if not 0 < pct <= 100:
            raise BudgetError(f"--dram-budget {text!r}: a percentage must be in (0, 100]")
        return int(model_bytes * pct / 100)
    try:
        return parse_size(t)
    except ProfileError:
        raise BudgetError(f"--dram-budget {text!r} is not a size (e.g. 1.5GiB, 560MiB) or a "
                          f"percentage of the model (e.g. 50%)") from None


def process_rss() -> int:
    """Resident bytes of this process now (Linux /proc; 0 where unavailable)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096
    except (OSError, IndexError, ValueError):
        return 0


def read_manifest(path: Path) -> dict:
    """The manifest of a converted model, without loading anything else."""
    try:
        return json.loads((Path(path) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise BudgetError(f"{path}: cannot read manifest.json ({e})") from None


def model_bytes(manifest: dict) -> int:
    """Bytes of the converted model's weights: dense.bin + ffn.bin."""
    return int(manifest["dense"]["nbytes"]) + int(manifest["ffn"]["nbytes"])


def resident_bytes(manifest: dict, n_ctx: int, process: int, predictor: int,
                   reader_stage: int, stride_rows: int) -> dict:
    """Everything but the neuron caches, by what it is (see the module docstring)."""
    c = manifest["config"]
    kv = 2 * c["n_layers"] * n_ctx * c["n_kv_heads"] * c["head_dim"] * 4
    work = WORK_FIXED + 4 * 4 * c["vocab_size"] + reader_stage + stride_rows
    return {"dense weights": int(manifest["dense"]["nbytes"]), "KV cache": kv,
            "tokenizer": TOKENIZER_FACTOR * int(manifest["tokenizer"].get("nbytes") or 0),
            "process": process, "buffers": work, "predictor": predictor}


def plan_budget(manifest: dict, budget_text: str, n_ctx: int, process: int, predictor: int = 0,
                reader_stage: int = 0, naive: bool = False, pin_fraction: float = 0.5) -> BudgetPlan:
    """Size the neuron caches from the budget; BudgetError (one line) when it cannot work."""
    f = manifest["ffn"]
    n_layers, n_ff, stride = int(f["n_layers"]), int(f["n_ff"]), int(f["stride"])
    budget = parse_budget(budget_text, model_bytes(manifest))
    staging_rows = min(n_ff, max(1, STAGING_BYTES // stride))
    resident = resident_bytes(manifest, n_ctx, process, predictor, reader_stage,
                              staging_rows * stride)
    fixed = sum(resident.values()) + (0 if naive else 4 * n_ff * n_layers)
    dense = resident["dense weights"]
    if budget < dense:
        raise BudgetError(f"--dram-budget {budget_text} ({mib(budget, up=False)}) cannot hold the "
                          f"{mib(dense)} of dense weights (embeddings, attention, norms) that stay "
                          f"in DRAM; streaming them from flash is not implemented yet: give at "
                          f"least {mib(fixed)}")
    if budget < fixed:
        parts = ", ".join(f"{k} {mib(v)}" for k, v in resident.items() if v)
        raise BudgetError(f"--dram-budget {budget_text} ({mib(budget, up=False)}) is below the "
                          f"{mib(fixed)} that must stay resident ({parts}); give at least "
                          f"{mib(fixed)}, or lower --ctx-size")
    capacity = 0 if naive else min(n_ff, (budget - fixed) // (n_layers * (stride + ROW_MAP_BYTES)))
    hot_first = f.get("neuron_order") is not None
    pins = capacity if capacity == n_ff else int(capacity * pin_fraction) if hot_first else 0
    notes = () if hot_first or naive else ("no hot-first neuron order (run calibrate): "
                                           "nothing pinned",)
    return BudgetPlan(budget, resident, n_layers, n_ff, stride, int(capacity), int(pins),
                      staging_rows, notes)
