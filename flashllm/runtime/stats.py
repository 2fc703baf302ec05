"""Per-token counters of the flash FFN for --stats: I/O, cache, predictor, latency split.

The latency split follows the paper's Table 3: I/O (time the forward pass waited for reads),
memory management (cache lookups, inserts, evictions and their row copies), compute (FFN kernels
and the predictor). The reader's own wall time and bytes give the effective read throughput,
which is set against the cost model's figure for reads of that average size.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from flashllm.units import GiB, KiB, MiB

FIELDS = ("bytes_read", "bytes_requested", "gap_bytes", "reads", "read_s", "ring_idle_s", "io_s",
          "mm_s", "compute_s", "predict_s", "active", "hits", "streamed", "true_active", "true_hits",
          "experts", "expert_hits", "expert_reads", "prefetched", "prefetch_used", "guessed",
          "guessed_right")


@dataclass
class TokenStats:
    """One forward pass of the flash FFN (all layers). bytes: from the device; *_s: seconds."""

    kind: str = "decode"               # "decode" (one fed token + draft guesses) or "prefill"
    n_tokens: int = 1
    bytes_read: int = 0                # device bytes, page padding and merge gaps included
    bytes_requested: int = 0           # bundle bytes asked for
    gap_bytes: int = 0                 # holes read through to merge reads
    reads: int = 0                     # pread calls after merging
    read_s: float = 0.0                # wall time inside the reader
    ring_idle_s: float = 0.0           # the read-ahead ring waited for a free buffer (device idle)
    io_s: float = 0.0                  # time the forward pass waited for reads
    mm_s: float = 0.0                  # cache bookkeeping
    compute_s: float = 0.0             # FFN kernels
    predict_s: float = 0.0             # predictor
    active: int = 0                    # predicted-active neurons, summed over layers
    hits: int = 0                      # of them already in DRAM
    streamed: int = 0                  # read into the staging buffer (not cached)
    true_active: int = 0               # exact mask size (check mode only)
    true_hits: int = 0                 # exact active neurons the predictor found (check mode only)
    experts: int = 0                   # mixture of experts: experts routed, summed over layers
    expert_hits: int = 0               # of them already in DRAM (cached, read before this pass)
    expert_reads: int = 0              # of them read now (not cached, not read ahead)
    prefetched: int = 0                # experts read ahead on the next layer's guessed routing
    prefetch_used: int = 0             # of those, routed when their layer came
    guessed: int = 0                   # routed experts of layers that had a guess
    guessed_right: int = 0             # of them, named by the guess

    def add_reads(self, delta: dict) -> None:
        """Add reader counters (reader_delta) of reads made for this pass."""
        for k, v in delta.items():
            setattr(self, k, getattr(self, k) + v)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.active if self.active else 0.0

    @property
    def avg_read(self) -> float:
        return self.bytes_read / self.reads if self.reads else 0.0

    @property
    def gib_s(self) -> float:
        return self.bytes_read / self.read_s / GiB if self.read_s > 0 else 0.0

    @property
    def recall(self) -> Optional[float]:
        """Share of the exact active set the predictor found (check mode)."""
        return self.true_hits / self.true_active if self.true_active else None

    @property
    def precision(self) -> Optional[float]:
        """Share of the predicted set that is exactly active (check mode)."""
        return self.true_hits / self.active if self.true_active and self.active else None


@dataclass
class FlashStats:
    """Token records in order; `expected_gib_s(avg_read)` gives the profile's figure."""

    mode: str
    plan: dict = field(default_factory=dict)
    tokens: list = field(default_factory=list)

    def start(self, kind: str, n_tokens: int) -> TokenStats:
        rec = TokenStats(kind=kind, n_tokens=n_tokens)
        self.tokens.append(rec)
        return rec

    def to_dict(self, expected: Callable[[float], float]) -> dict:
        decode = [t for t in self.tokens if t.kind == "decode"]
        rows = [{**asdict(t), "hit_rate": t.hit_rate, "avg_read": t.avg_read, "gib_s": t.gib_s,
                 "profile_gib_s": expected(t.avg_read) if t.reads else 0.0, "recall": t.recall,
                 "precision": t.precision}
                for t in self.tokens]
        mean = _mean(decode, expected)
        return {"ffn": self.mode, "plan": self.plan, "summary": _summary(mean), "tokens": rows,
                "decode_mean": mean}


def _mean(recs: list, expected: Callable[[float], float]) -> dict:
    """Per-token means over decode records, plus the overall throughput figures."""
    if not recs:
        return {}
    n = len(recs)
    total = TokenStats()
    for r in recs:
        for f in FIELDS:
            setattr(total, f, getattr(total, f) + getattr(r, f))
    out = {f: getattr(total, f) / n for f in FIELDS}
    out.update(hit_rate=total.hit_rate, avg_read=total.avg_read, gib_s=total.gib_s,
               profile_gib_s=expected(total.avg_read) if total.reads else 0.0,
               recall=total.recall, precision=total.precision, tokens=n)
    return out


def _summary(m: dict) -> dict:
    """Per decode token figures under the names scripts/bench/stats.py looks for."""
    if not m:
        return {}
    return {"io_bytes_per_token": m["bytes_read"], "reads_per_token": m["reads"],
            "avg_read_bytes": m["avg_read"], "effective_gibs": m["gib_s"],
            "profile_gibs": m["profile_gib_s"], "hit_rate": m["hit_rate"],
            "io_ms_per_token": 1e3 * m["io_s"], "mm_ms_per_token": 1e3 * m["mm_s"],
            "compute_ms_per_token": 1e3 * m["compute_s"],
            "predictor_ms_per_token": 1e3 * m["predict_s"], "recall": m["recall"],
            "precision": m["precision"], "active_per_token": m["active"],
            "decode_tokens": m["tokens"], **_expert_summary(m)}


def _expert_summary(m: dict) -> dict:
    """A mixture of experts' per-token figures ({} for a dense FFN)."""
    if not m.get("experts"):
        return {}
    return {"experts_per_token": m["experts"], "experts_cached_per_token": m["expert_hits"],
            "experts_read_per_token": m["expert_reads"],
            "experts_prefetched_per_token": m["prefetched"],
            "prefetch_used_per_token": m["prefetch_used"],
            "prefetch_hit_rate": m["prefetch_used"] / m["prefetched"] if m["prefetched"] else None,
            "guess_recall": m["guessed_right"] / m["guessed"] if m["guessed"] else None}


def stats_table(d: dict) -> str:
    """A per-token text table of FlashStats.to_dict output (stderr of `run --stats`)."""
    head = (f"{'tok':>4} {'kind':>7} {'MB read':>8} {'reads':>6} {'avg KiB':>8} {'GiB/s':>6} "
            f"{'prof':>5} {'hit%':>5} {'io ms':>7} {'mm ms':>6} {'comp ms':>8} {'pred ms':>7} "
            f"{'recall':>6}")
    lines = [f"flash FFN ({d['ffn']}): {d.get('plan', {}).get('summary', '')}", head]
    if "tokens" not in d:                 # the whole FFN resident (DenseFfn): nothing read
        return lines[0] + "\nevery neuron in DRAM: no FFN reads"
    for i, t in enumerate(d["tokens"]):
        lines.append(_row(str(i), t))
    if d["decode_mean"]:
        lines.append(_row("mean", {**d["decode_mean"], "kind": "decode"}))
    s = d.get("summary") or {}
    if "experts_per_token" in s:
        rate = lambda v: "-" if v is None else f"{v:.0%}"              # noqa: E731
        lines.append(f"experts per decode token: {s['experts_per_token']:.1f} routed, "
                     f"{s['experts_cached_per_token']:.1f} cached, {s['experts_read_per_token']:.1f} "
                     f"read, {s['experts_prefetched_per_token']:.1f} prefetched "
                     f"({rate(s['prefetch_hit_rate'])} of them used); the next layer's guess "
                     f"named {rate(s['guess_recall'])} of its routed experts")
    return "\n".join(lines)


def _row(label: str, t: dict) -> str:
    recall = "-" if t.get("recall") is None else f"{t['recall']:.3f}"
    return (f"{label:>4} {t['kind']:>7} {t['bytes_read'] / MiB:8.2f} {t['reads']:6.0f} "
            f"{t['avg_read'] / KiB:8.1f} {t['gib_s']:6.2f} {t['profile_gib_s']:5.2f} "
            f"{100 * t['hit_rate']:5.1f} {1e3 * t['io_s']:7.2f} {1e3 * t['mm_s']:6.2f} "
            f"{1e3 * t['compute_s']:8.2f} {1e3 * t['predict_s']:7.2f} {recall:>6}")
