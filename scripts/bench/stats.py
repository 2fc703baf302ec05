"""The flash columns of the benchmark table from `flashllm run --stats --json` output.

The run's JSON is flattened ("a.b.c" keys) and each column takes the first key that names its
figure; a figure the run does not report shows "–". Keys are matched by name fragments so that
the table follows the runtime's stats() without a lock-step change here.
"""
from __future__ import annotations

import re
from typing import Dict, Optional, Sequence

# `flashllm run --stats` prints a per-token table on stderr; its "mean decode" row, by position
TABLE_HEADER = "tok kind MB read reads avg KiB GiB/s prof hit% io ms mm ms comp ms pred ms recall"
TABLE_KEYS = (("io_bytes_per_token", 1e6), ("reads_per_token", 1), ("avg_read_bytes", 1024),
              ("effective_gibs", 1), ("profile_gibs", 1), ("hit_rate", 0.01), ("io_ms_per_token", 1),
              ("mm_ms_per_token", 1), ("compute_ms_per_token", 1), ("predictor_ms_per_token", 1),
              ("recall", 1))

COLUMNS = {  # column -> (key fragments tried in order, scale, digits)
    "mb_tok": (("io_bytes_per_token", "bytes_per_token", "ffn_bytes_per_token"), 1e-6, 1),
    "reads_tok": (("reads_per_token", "n_reads_per_token"), 1.0, 0),
    "avg_read_kib": (("avg_read_bytes", "average_read_bytes", "mean_read_bytes"), 1 / 1024, 0),
    "gib_run": (("effective_gibs", "effective_gib_s", "read_gibs", "io_gibs"), 1.0, 2),
    "gib_profile": (("profile_gibs", "profile_gib_s"), 1.0, 2),
    "hit": (("hit_rate", "cache_hit_rate"), 1.0, 3),
    "recall": (("recall",), 1.0, 3),
    "precision": (("precision",), 1.0, 3),
    "io_ms": (("io_ms_per_token", "io_s_per_token", "io_ms"), 1.0, 1),
    "mm_ms": (("mm_ms_per_token", "memory_ms_per_token", "mm_ms"), 1.0, 1),
    "compute_ms": (("compute_ms_per_token", "compute_ms"), 1.0, 1),
    "pred_ms": (("predictor_ms_per_token", "pred_ms"), 1.0, 1),
}


def parse_stats_table(stderr: str) -> Dict[str, object]:
    """The mean decode row of the --stats table (keys as TABLE_KEYS), and the budget line as
    "plan"; {} when the table is absent or its header is not the one known here."""
    lines = stderr.splitlines()
    out: Dict[str, object] = {}
    plan = next((ln.strip() for ln in lines if ln.startswith("flash FFN")), None)
    if plan:
        out["plan"] = plan
    if not any(" ".join(ln.split()) == TABLE_HEADER for ln in lines):
        return out
    row = next((ln.split() for ln in lines if ln.split()[:2] == ["mean", "decode"]), None)
    if row is None or len(row) != 2 + len(TABLE_KEYS):
        return out
    for (key, scale), cell in zip(TABLE_KEYS, row[2:]):
        if re.fullmatch(r"-?[0-9.]+", cell):
            out[key] = float(cell) * scale
    return out


def flatten(d: dict, prefix: str = "") -> Dict[str, object]:
    out: Dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def find(flat: Dict[str, object], fragments: Sequence[str]) -> Optional[float]:
    """The first numeric value whose key's last part is one of fragments (a list: its mean)."""
    for frag in fragments:
        for key, v in flat.items():
            if key.split(".")[-1] != frag:
                continue
            if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
                return sum(v) / len(v)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
    return None


def stat_cells(parsed: dict, probe: Optional[float] = None) -> Dict[str, str]:
    """Table cells: mb_tok, reads_tok, avg_read_kib, gibs, hit, recall, split (strings). probe:
    the device's GiB/s measured right before and after the run (read_probe.py)."""
    flat = flatten(parsed)
    val = {c: find(flat, frags) for c, (frags, _, _) in COLUMNS.items()}
    # the FFN figures are per decode pass (n_decode passes); a pass that verifies draft guesses
    # makes 1 + the guesses it keeps (n_accepted in all): per token made, x passes / tokens
    passes = find(flat, ("n_decode",)) or 0
    made = passes + (find(flat, ("n_accepted",)) or 0)
    if passes and made:
        for c in ("mb_tok", "reads_tok"):
            val[c] = None if val[c] is None else val[c] * passes / made

    def cell(c: str) -> str:
        v = val[c]
        return "–" if v is None else f"{v * COLUMNS[c][1]:.{COLUMNS[c][2]}f}"

    gibs = cell("gib_run") + (f" ({cell('gib_profile')})" if val["gib_profile"] is not None else "")
    if probe and val["gib_run"]:
        gibs += f" [{probe:.2f}: {val['gib_run'] / probe:.2f}]"
    dense = find(flat, ("dense_bytes_read",))         # over the prefill and every decode pass
    tokens = made + 1                                 # tokens made, the prefill's included
    tps, per_tok = find(flat, ("decode_tps",)), val["mb_tok"]
    if tps and per_tok:            # the whole decode: every byte a token reads x tokens/s
        gibs += f" / {(per_tok + (dense or 0) / tokens) * tps / 2**30:.2f}"
    rp = "–" if val["recall"] is None else f"{cell('recall')} / {cell('precision')}"
    split = "–" if val["io_ms"] is None else \
        f"{cell('io_ms')} / {cell('mm_ms')} / {cell('compute_ms')} / {cell('pred_ms')}"
    mb_tok = cell("mb_tok") + (f" + {dense / tokens * 1e-6:.0f}" if dense else "")
    return {"mb_tok": mb_tok, "reads_tok": cell("reads_tok"), "avg_read_kib": cell("avg_read_kib"),
            "gibs": gibs, "hit": cell("hit"), "recall": rp, "split": split}
