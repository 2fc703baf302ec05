"""`make bench`'s "Mixture of experts under a cap" section (issue 52): scripts/bench/moe.py's
table, the OLMoE-shape Q4_0 and Q4_K_M fixtures, the default conversion (native) and of the Q4_0
fixture `--dtype q4_0` for comparison, under cgroup caps of 1/2 and 1/4 of the GGUF, cold, next to llama.cpp.

Run:  python -m scripts.bench.bench --sections moe [--quick] [--models olmoe-shape-q4_0]
--quick: nothing (SmolLM2 only), or with --models the fixtures it names, the default conversion
only. The fixtures and conversions live in build/moe (moe.BUILD, shared with the "GGUFs in DRAM"
row of the Q4_0 fixture).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from flashllm.format.layout import NATIVE
from scripts.bench import moe
from scripts.bench.cgroup_run import unavailable_reason
from scripts.bench.harness import Bench, loadavg, show_py
from scripts.bench.report import run_line

TITLE = "## Mixture of experts under a cap"
# fixture kind -> its conversions: the default, and for Q4_0 also `--dtype q4_0` (issue 52: the
# default at least as fast as it; the Q4_K_M fixture's re-quantization would add 4 GiB and ~7 min)
KINDS = {"q4_0": [NATIVE, "q4_0"], "q4_k_m": [NATIVE]}
CAPS = ("1/2", "1/4")
N_GEN = 16


def plan(b: Bench) -> Dict[str, List[str]]:
    """Fixture kind -> the conversions this run measures (--quick: the default only)."""
    return {k: [NATIVE] if b.args.quick else dts for k, dts in KINDS.items()
            if b.wants(f"olmoe-shape-{k}", not b.args.quick)}


def commands(results: List[dict]) -> List[str]:
    """One line per cap and fixture: llama.cpp's command and each conversion's `run`."""
    out, seen = [], set()
    for r in results:
        limit = f"`python -m scripts.bench.cgroup_run --cold --limit {r['cap_bytes']} -- "
        if (r["gguf"], r["cap"]) not in seen:
            seen.add((r["gguf"], r["cap"]))
            out.append(f"- {r['gguf'].upper()}, cap {r['cap']}: llama.cpp {limit}"
                       f"{show_py(r['llama.cpp']['cmd'])}`")
        out.append(f"- {moe.label(r['gguf'], r['dtype'])}, cap {r['cap']}: {limit}"
                   f"{r['flashllm']['shown']}`")
    return out


def conversions(results: List[dict]) -> List[str]:
    done = {(r["gguf"], r["dtype"]): r["model"] for r in results}
    return [f"`flashllm convert build/moe/olmoe-shape-{kind}.gguf -o {model}"
            + ("" if dt == NATIVE else f" --dtype {dt}") + "`" for (kind, dt), model in done.items()]


def section_text(b: Bench, results: List[dict], load: tuple) -> str:
    text = [TITLE, "", run_line(b.info, *load), "",
            "scripts/bench/moe.py (issue 52): random-weight GGUFs in OLMoE-1B-7B's shape (16 "
            "layers, 64 experts, top-8, d_model 2048, expert n_ff 1024; "
            "scripts/fixtures/make_moe_gguf.py: `q4_0` every matrix Q4_0, `q4_k_m` llama.cpp's "
            "Q4_K_M mix), each run in a memory cgroup capped at a fraction of the GGUF's size from "
            "a cold page cache, 2 threads, one run per cell. flashllm: the default conversion "
            "(`flashllm convert X.gguf`, what `run X.gguf` does: each expert's rows the GGUF's "
            "own) and, of the Q4_0 fixture, `--dtype q4_0` for comparison, `run` with `--dram-budget` = the cap on a "
            f"64-byte code prompt, {N_GEN} tokens at temperature 1, seed 1 (greedy decoding of "
            "random weights repeats one token and with it the same experts: a best case), "
            "`--stats --json`. llama.cpp: scripts/bench/llamacpp.py, file-backed (mmap), OpenMP "
            f"passive, 64 fixed token ids then {N_GEN} tokens, no warm-up. The routing is "
            "near-uniform (scripts/bench/moe_routing.py), the worst case for an expert cache. "
            "MiB read per token against the routed experts' MiB; experts per token cached / "
            "read from flash / prefetched; the read-ahead's guesses used, and their recall.", ""]
    text += moe.HEADER
    text += [moe.row(moe.label(r["gguf"], r["dtype"]), r["cap"], r["cap_bytes"], r["llama.cpp"],
                     r["flashllm"], r["active"]) for r in results]
    text += ["", "Commands (conversions: " + "; ".join(conversions(results)) + "):", ""]
    text += commands(results)
    done = {(r["gguf"], r["dtype"]) for r in results}
    skipped = [moe.label(k, d) for k, dts in KINDS.items() for d in dts if (k, d) not in done]
    if skipped:
        text += ["", f"- not in this run: {'; '.join(skipped)} (quick mode or --models)."]
    return "\n".join(text) + "\n"


def section(b: Bench) -> Optional[Tuple[str, str, list]]:
    """(title, text, raw results) of this section, or None when it cannot run here (no cgroup:
    every row is capped)."""
    reason = unavailable_reason()
    if reason:
        b.log(f"moe: skipped, {reason}")
        return None
    kinds = plan(b)
    if not kinds:
        return None
    start, results = loadavg(), []
    b.log(f"moe: fixtures and conversions {kinds}, caps {list(CAPS)}")
    try:
        for kind, dtypes in kinds.items():
            results += moe.collect(b.fl, moe.BUILD, [kind], dtypes, list(CAPS), N_GEN,
                                   lambda line: b.log(f"moe: {line}"))
    except RuntimeError as e:         # a conversion failed: the file keeps the section it has
        b.log(f"moe: not written, {e}")
        return None
    return TITLE, section_text(b, results, (start, loadavg())), results
