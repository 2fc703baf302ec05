"""Structured output (issue 51): JSON schemas at temperature 0.8, what the mask costs, and the
output head's bytes a constrained token reads under a DRAM budget.

Run:  python -m scripts.bench.grammar [--models smollm2-135m,qwen2.5-coder-0.5b]
      [--prompts 50] [--n 256] [--pairs 8] [--budget-model qwen2.5-coder-1.5b]
      [--budget 560MiB] [--parts validity,mask,head] [--out build/bench-grammar.json]

validity: per model (all weights in DRAM, one load), each of SCHEMAS x --prompts held-out
  prompts (the model's chat template around PROMPTS' wording of SUBJECTS) at temperature 0.8,
  seed = the prompt's index, up to --n tokens: valid (json.loads, then jsonschema validates:
  the reference, never our own matcher), cut (-n ran out before the grammar completed, and the
  run says so) or invalid (anything else: the figure that must be 0).
mask: on the first model of --mask-model, in DRAM, one pass a token (no forced-token drafting):
  --pairs pairs of the same prompt constrained (the object schema) and unconstrained, run
  alternately; ms a token (decode + sampling) of each, and the masks' own seconds
  (ConstrainedSampler.mask_s) as a share of the constrained run's.
head: `flashllm run --budget-model --dram-budget --budget --sparse-head --stats --json`
  (subprocesses; a folder is run as it is, a name is calibrated once first), the object schema
  against no schema, greedy, the same prompt, alternating: the head's bytes a token (the
  sketch's and the rows') and decode tok/s.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scripts.bench.flashllm_cli import ROOT, parse_run
from scripts.bench.harness import Bench

SCHEMAS = {
    "object": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 60}},
        "required": ["name", "age", "email"], "additionalProperties": False},
    "array": {"type": "array", "items": {"type": "string", "maxLength": 30},
              "minItems": 1, "maxItems": 5},
    "enum": {"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "confidence": {"enum": ["low", "medium", "high"]}},
        "required": ["sentiment", "confidence"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40},
        "author": {"type": "object", "properties": {
            "first": {"type": "string", "maxLength": 20},
            "last": {"type": "string", "maxLength": 20}},
            "required": ["first", "last"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 3}},
        "required": ["title", "author", "tags"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "temperature": {"type": "number", "minimum": -50, "maximum": 60},
        "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
        "wind": {"type": "number", "exclusiveMinimum": 0, "maximum": 200}},
        "required": ["temperature", "humidity", "wind"], "additionalProperties": False},
}
PROMPTS = {
    "object": "Write a JSON record (name, age, email) for a fictional person: {}.",
    "array": "List up to five short keywords about {} as a JSON array of strings.",
    "enum": "Would a story about {} feel positive, negative or neutral? Answer as JSON with "
            "your sentiment and confidence.",
    "nested": "Describe a book about {} as JSON: title, author (first and last name), tags.",
    "numbers": "Report today's weather where {} lives as JSON: temperature in C, humidity in "
               "percent, wind in km/h.",
}
SUBJECTS = [   # held out: no prompt of development used them
    "a baker in Lyon", "a retired astronaut", "a lighthouse keeper", "a chess prodigy",
    "a beekeeper in Crete", "a night-shift nurse", "a glassblower", "a marathon runner",
    "a jazz pianist", "a mountain guide", "a ferry captain", "a street photographer",
    "a cheese maker", "a bridge engineer", "a violin restorer", "a forest ranger",
    "a sushi chef", "a translator of poetry", "a rock climber", "a school librarian",
    "a wind farm technician", "a puppeteer", "a tea farmer in Darjeeling", "a subway driver",
    "a wildlife vet", "a typewriter collector", "a ballet teacher", "a cartographer",
    "a deep-sea diver", "a bookbinder", "a cyclist crossing Africa", "a radio host",
    "a volcano scientist", "a carpenter", "a kite maker", "a museum guard", "an apple grower",
    "a stage magician", "a court stenographer", "an ice sculptor", "a blacksmith",
    "a sailmaker", "a crossword setter", "a train conductor", "an orchid breeder",
    "a circus acrobat", "a data analyst", "a potter in Kyoto", "a sheep farmer in Wales",
    "a clock repairer",
]


def load(name: str, n_ctx: int, threads: int):
    """The model `name` (a models.toml name, a GGUF or a folder) in DRAM as `run -i` assembles it:
    (parts, the chat template)."""
    from flashllm.cli.app import cache_dir, model_path
    from flashllm.serve.model import chat_template
    from flashllm.session.run import Drafting, FlashAsked, assemble, request
    from flashllm.session.stream import Sampling
    req = request(model_path(name), FlashAsked(), Sampling(), Drafting(0, "lookup"), threads,
                  n_ctx, None)
    parts = assemble(req, cache_dir(), lambda m: print(m, file=sys.stderr))
    return parts, chat_template(parts.flash, parts.tok)


def generate_one(parts, template, text: str, sampler, n: int, draft=None) -> dict:
    """One answer to a user message: its text, tokens, GenStats."""
    from flashllm.generation.generate import generate
    prompt = template.render([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = parts.tok.encode(prompt, add_special=False)
    out: list = []
    stats = generate(parts.net, sampler, ids, n, stop_ids=parts.tok.eos_ids,
                     on_token=out.append, draft=draft)
    return {"text": parts.tok.decode(out), "stats": stats}


def verdict(text: str, schema: dict, complete: bool) -> str:
    """valid / cut / invalid, by the independent references json and jsonschema."""
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), schema)
        return "valid"
    except (ValueError, jsonschema.ValidationError):
        return "invalid" if complete else "cut"


def validity(name: str, prompts: int, n: int, threads: int, log) -> dict:
    """Counts of valid / cut / invalid answers of model `name` per schema, and examples."""
    from flashllm.generation.sampler import SamplerParams
    from flashllm.session.structured import constrained, grammar_draft, token_env_of
    parts, template = load(name, 1024, threads)
    env = token_env_of(parts.tok, parts.flash)
    out = {}
    try:
        for kind, schema in SCHEMAS.items():
            grammar = compile_schema(schema)
            counts, t0 = {"valid": 0, "cut": 0, "invalid": 0, "tokens": 0}, time.perf_counter()
            for i, subject in enumerate(SUBJECTS[:prompts]):
                sampler = constrained(SamplerParams(temp=0.8, seed=i), env, grammar)
                got = generate_one(parts, template, PROMPTS[kind].format(subject), sampler, n,
                                   grammar_draft(sampler, None))
                v = verdict(got["text"], schema, sampler.accepting())
                counts[v] += 1
                counts["tokens"] += got["stats"].n_gen
                if v == "invalid" or i < 2:
                    counts.setdefault("examples", []).append(got["text"][:200])
            counts["seconds"] = round(time.perf_counter() - t0, 1)
            log(f"{name} {kind}: {counts}")
            out[kind] = counts
    finally:
        parts.close()
    return out


def compile_schema(schema: dict) -> str:
    from flashllm.session.structured import OutputFormat
    return OutputFormat("json_schema", json.dumps(schema)).compile()


def mask_cost(name: str, pairs: int, n: int, threads: int, log) -> dict:
    """ms a token constrained (object schema) and not, alternating, one pass a token."""
    from flashllm.generation.sampler import Sampler, SamplerParams
    from flashllm.session.structured import constrained, token_env_of
    parts, template = load(name, 1024, threads)
    env, grammar = token_env_of(parts.tok, parts.flash), compile_schema(SCHEMAS["object"])
    text = PROMPTS["object"].format("a harbour pilot")
    rows = {"constrained": [], "free": [], "mask_share": []}
    try:
        for i in range(pairs):
            for kind in ("constrained", "free") if i % 2 == 0 else ("free", "constrained"):
                params = SamplerParams(temp=0.8, seed=100 + i)
                sampler = constrained(params, env, grammar) if kind == "constrained" \
                    else Sampler(params)
                s = generate_one(parts, template, text, sampler, n)["stats"]
                spent = s.decode_s + s.sample_s
                rows[kind].append(1e3 * spent / max(s.n_gen, 1))
                if kind == "constrained":
                    rows["mask_share"].append(sampler.mask_s / spent)
    finally:
        parts.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    out = {"ms_per_token": {k: round(med[k], 2) for k in ("constrained", "free")},
           "cost_pct": round(100 * (med["constrained"] / med["free"] - 1), 1),
           "mask_pct": round(100 * med["mask_share"], 2), "pairs": pairs, "n": n, "raw": rows}
    log(f"mask cost on {name}: {out['ms_per_token']}, {out['cost_pct']}% slower, masks "
        f"{out['mask_pct']}% of the constrained run's time")
    return out


def head_reads(name: str, budget: str, n: int, threads: int, log) -> dict:
    """`run --dram-budget --stats --json` with the object schema and without: head bytes a token."""
    prompt = "Write a JSON record (name, age, email) for a fictional person: a harbour pilot."
    out = {}
    for kind in ("free", "constrained", "free", "constrained"):
        argv = [sys.executable, "-m", "flashllm", "run", name, "-p", prompt, "-n", str(n),
                "--temp", "0", "-t", str(threads), "--dram-budget", budget, "--sparse-head",
                "--stats", "--json"]
        if kind == "constrained":
            argv += ["-j", json.dumps(SCHEMAS["object"])]
        p = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=3600)
        d = parse_run(p.stderr) or {}
        h = (d.get("flash") or {}).get("dense") or {}
        tokens = max(h.get("head_tokens", 0), 1)
        row = {"decode_tps": d.get("decode_tps"), "n_gen": d.get("n_gen"),
               "n_decode": d.get("n_decode"), "head_tokens": h.get("head_tokens"),
               "sketch_bytes_per_token": h.get("head_sketch_bytes", 0) / tokens,
               "row_bytes_per_token": 4096 * h.get("head_pages", 0) / tokens,
               "allowed_only": h.get("head_allowed_only"), "rc": p.returncode,
               "text": p.stdout[:120], "cmd": "flashllm " + " ".join(argv[3:])}
        row["head_bytes_per_token"] = row["sketch_bytes_per_token"] + row["row_bytes_per_token"]
        row["head_bytes_per_made"] = row["head_bytes_per_token"] * tokens / max(d.get("n_gen")
                                                                                or 1, 1)
        out.setdefault(kind, []).append(row)
        log(f"head reads {kind}: {row}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--mask-model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--budget-model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--budget", default="560MiB")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parts", default="validity,mask,head")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "bench-grammar.json")
    args = ap.parse_args()
    log = lambda m: print(f"[grammar] {m}", file=sys.stderr, flush=True)   # noqa: E731
    raw = collect(vars(args), log)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(raw, indent=1, default=str))
    print(grammar_section(raw))


QUICK = {"models": "smollm2-135m", "prompts": 5, "n": 256, "pairs": 4,
         "mask_model": "smollm2-135m", "threads": 2, "parts": "validity,mask"}
FULL = {"models": "smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b", "prompts": 50,
        "n": 256, "pairs": 8, "mask_model": "qwen2.5-coder-0.5b",
        "budget_model": "qwen2.5-coder-1.5b", "budget": "560MiB", "threads": 2,
        "parts": "validity,mask,head"}


def collect(opts: dict, log) -> dict:
    """The parts opts["parts"] names (FULL's keys; bench.py passes QUICK or FULL), raw."""
    raw = {"args": {k: str(v) for k, v in opts.items() if k != "out"}}
    parts = opts["parts"].split(",")
    if "validity" in parts:
        raw["validity"] = {m: validity(m, int(opts["prompts"]), int(opts["n"]),
                                       int(opts["threads"]), log)
                           for m in opts["models"].split(",")}
    if "mask" in parts:
        raw["mask"] = mask_cost(opts["mask_model"], int(opts["pairs"]), 64, int(opts["threads"]),
                                log)
    if "head" in parts:
        raw["head"] = head_reads(opts["budget_model"], opts["budget"], 64, int(opts["threads"]),
                                 log)
    return raw


def grammar_section(raw: dict) -> str:
    """BENCHMARKS.md's "## Structured output" section (markdown) from a run's raw results:
    one row a model (each schema's valid answers, those cut by -n in brackets), then the mask's
    cost and the head's bytes a token."""
    a = raw["args"]
    lines = ["## Structured output", "",
             f"`python -m scripts.bench.grammar` (issue 51): {a.get('prompts')} held-out prompts "
             f"x {len(SCHEMAS)} JSON schemas at temperature 0.8, -n {a.get('n')}, in DRAM; "
             "valid = parses and validates under jsonschema, (cut) = -n ran out first and the "
             "run said so.", ""]
    if "validity" in raw:
        lines += ["| model | " + " | ".join(SCHEMAS) + " | invalid |",
                  "|---|" + "---:|" * (len(SCHEMAS) + 1)]
        for model, kinds in raw["validity"].items():
            cells = [f"{c['valid']} ({c['cut']})" for c in kinds.values()]
            bad = sum(c["invalid"] for c in kinds.values())
            lines.append(f"| {model} | " + " | ".join(cells) + f" | {bad} |")
        lines.append("")
    if "mask" in raw:
        m = raw["mask"]
        lines.append(f"- The mask in DRAM on {a.get('mask_model')} ({m['pairs']} alternating "
                     f"pairs of {m['n']} tokens, one pass a token): {m['ms_per_token']['constrained']}"
                     f" ms a token constrained, {m['ms_per_token']['free']} ms free "
                     f"({m['cost_pct']:+}%); the masks themselves {m['mask_pct']}% of it.")
    if "head" in raw:
        cells = []
        for kind, rows in raw["head"].items():
            b = statistics.median(r["head_bytes_per_made"] for r in rows) / 2**20
            tps = statistics.median(r["decode_tps"] or 0 for r in rows)
            only = sum(r["allowed_only"] or 0 for r in rows)
            rows_read = sum(r["head_tokens"] or 0 for r in rows)
            cells.append(f"{kind} {b:.1f} MiB, {tps:.2f} tok/s ({only} of {rows_read} rows "
                         "read their allowed rows alone)")
        lines.append(f"- {a.get('budget_model')} under `--dram-budget {a.get('budget')} "
                     f"--sparse-head`, greedy, the head's bytes (sketch + rows, `--stats`) a "
                     "token made: " + "; ".join(cells) + ".")
    return "\n".join(lines) + "\n"


def section(b: Bench):
    """make bench's (title, text, raw): QUICK's parts with --quick, else FULL's."""
    raw = collect(QUICK if b.args.quick else FULL, b.log)
    return "## Structured output", grammar_section(raw), raw


if __name__ == "__main__":
    main()
