"""The README's picture: decode tok/s against the DRAM budget, flashllm and llama.cpp, from the
"## Flash inference" rows of a `make bench` run (bench.py calls `draw` with its rows) or from the
table BENCHMARKS.md holds (this module's entry point, which feeds the same function).

Run:  python -m scripts.bench.budget_plot [--from BENCHMARKS.md] [--out docs/budget.png]
Needs matplotlib (pyproject's `bench` extra, which `make bench` installs)."""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
MODEL = "qwen2.5-coder-1.5b"
TITLE = "Qwen2.5-Coder-1.5B (a 1066 MiB GGUF file), 2 threads: decode speed"
FLASHLLM, LLAMACPP = "flashllm (default)", "llama.cpp"

Point = Tuple[str, Optional[float], Optional[float]]   # (cap label, flashllm tok/s, llama.cpp tok/s)


def points(rows: List[dict], model: str = MODEL) -> List[Point]:
    """One (cap, flashllm, llama.cpp) per cap of `model`, in the rows' order: flashllm as a user
    runs it, llama.cpp its fastest row at that cap (uncapped: the faster OpenMP policy)."""
    caps: Dict[str, Dict[str, Optional[float]]] = {}
    for r in rows:
        if r.get("model") != model:
            continue
        cell = caps.setdefault(r["cap_label"], {FLASHLLM: None, LLAMACPP: None})
        tps = r.get("decode_tps")
        if r.get("contender") == FLASHLLM:
            cell[FLASHLLM] = tps
        elif str(r.get("contender", "")).startswith(LLAMACPP) and tps:
            cell[LLAMACPP] = max(tps, cell[LLAMACPP] or 0.0)
    return [(cap, c[FLASHLLM], c[LLAMACPP]) for cap, c in caps.items()]


def cap_words(cap: str) -> str:
    return "no cap\n(all in DRAM)" if cap == "none" else f"{cap} cap"


def draw(pts: List[Point], out: Path, note: str = "") -> Path:
    """Grouped bars, log scale (the capped llama.cpp rows are ~1 tok/s), each bar labelled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=120)
    width = 0.38
    for k, (name, colour) in enumerate(((FLASHLLM.split()[0], "#1f77b4"), (LLAMACPP, "#bbbbbb"))):
        xs = [i + (k - 0.5) * width for i in range(len(pts))]
        ys = [p[1 + k] or 0.0 for p in pts]                                  # (n_caps,)
        bars = ax.bar(xs, ys, width, label=name, color=colour, edgecolor="#333333", linewidth=0.5)
        for bar, y in zip(bars, ys):
            if y:
                ax.annotate(f"{y:.1f}" if y < 100 else f"{y:.0f}", (bar.get_x() + width / 2, y),
                            ha="center", va="bottom", fontsize=9, xytext=(0, 2),
                            textcoords="offset points")
    ax.set_yscale("log")
    ax.set_ylim(0.5, max((p[1] or 0) for p in pts) * 2.5 if pts else 10)
    ax.set_xticks(range(len(pts)), [cap_words(p[0]) for p in pts])
    ax.set_ylabel("decode tokens / s (log scale)")
    ax.set_xlabel("process memory cap (cgroup) = flashllm's --dram-budget")
    ax.set_title(TITLE, fontsize=10)
    ax.legend(loc="upper right", frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.04 if note else 0, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(out)
    return out


def rows_from_markdown(text: str) -> List[dict]:
    """The "## Flash inference" table of BENCHMARKS.md as bench.py's row dicts (model, cap_label,
    contender, decode_tps); a cell that is not a number (an OOM-killed run) gives None."""
    section = re.split(r"(?m)^## ", text)
    flash = next((s for s in section if s.startswith("Flash inference")), "")
    rows = []
    for line in flash.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or cells[0] in ("model", "") or cells[0].startswith("---"):
            continue
        try:
            tps: Optional[float] = float(cells[3])
        except ValueError:
            tps = None
        rows.append({"model": cells[0], "cap_label": cells[1], "contender": cells[2],
                     "decode_tps": tps})
    return rows


def note(date: str, git: str) -> str:
    """The picture's footnote: which run it shows."""
    return f"make bench {date}, git {git}; BENCHMARKS.md, \"Flash inference\""


def run_note(text: str) -> str:
    m = re.search(r"(?m)^## Flash inference\s+Run: ([^,]+), git (\w+)", text)
    return note(m.group(1), m.group(2)) if m else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="src", type=Path, default=ROOT / "BENCHMARKS.md")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "budget.png")
    args = ap.parse_args()
    text = args.src.read_text(encoding="utf-8")
    pts = points(rows_from_markdown(text))
    if not pts:
        raise SystemExit(f"error: no {MODEL} rows in {args.src}'s \"## Flash inference\" table")
    print(draw(pts, args.out, run_note(text)))


if __name__ == "__main__":
    main()
