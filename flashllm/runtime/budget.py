"""The DRAM budget of a flash run: every resident byte accounted, the dense weights kept or
streamed, the neuron caches sized from what remains, and a one-line refusal before anything is
loaded when the budget cannot work.

Resident at run time (all counted against --dram-budget):
    process         the Python process before the model (interpreter, numpy, cffi): measured,
                    counted in whole PROCESS_STEPs so that a plan repeats from run to run
    tokenizer       a one-shot run's table once the `tokenizers` object is released, or a
                    chat's loaded object; its load peaks higher, before the model, and is
                    checked on its own (runtime/tokenizer_budget.py)
    KV cache        2 · n_layers · n_ctx · n_kv_heads · head_dim · 2 bytes (f16, as llama.cpp)
    work            logits and activations of one forward pass, the reader's staging buffers,
                    the sparse FFN's staging buffer for prefill / streamed neurons
    predictor       its nbytes
    dense weights   vectors (norms, biases) always; then, while the budget lasts, each layer's
                    attention matrices, the output head, and (only once the caches hold
                    the whole FFN) the embeddings. What does not fit streams from dense.bin
                    (runtime/weights.py) through two layer buffers and two head chunks; so does
                    the output head when the caches can take the DRAM it frees (the same
                    bytes read a token, and its compute overlaps its reads: _head_overlap).
    neuron caches   per layer (capacity, stride) rows + maps; the rest of the budget
A dense byte kept saves one byte read per token; a cache byte saves less (only its hits), and an
embedding row costs one small read per token: hence that order. A mixture of experts' cache byte
saves only the routed share, n_experts_used / n_experts of it per token (ffn_reads): its output
head is worth keeping over the caches, and its caches hold whole experts (_cache_rows).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from flashllm.ffi import kernel
from flashllm.format.layout import SKETCH_NAMES, layer_strides
# BudgetError and parse_budget are imported from here too (the tests, the scripts)
from flashllm.runtime.budget_given import (Budget, BudgetError, check_tokenizer_load,  # noqa: F401
                                           parse_budget, refuse)
from flashllm.runtime.tokenizer_budget import tokenizer_resident
from flashllm.runtime.layer import attn_names
from flashllm.runtime.weights import CHUNK_BYTES, aligned_offsets
from flashllm.units import MiB, format_size

PROCESS_STEP = 8 * MiB          # the process is counted in whole steps (process_rss)
STAGING_BYTES = 16 * MiB       # the sparse FFN's staging buffer: prefill halves, the decode read-ahead ring
                               # (a small model then takes one chunk per layer, not four: every
                               # chunk is a kernel call that wakes the threads)
RING_BUFFERS = 4               # the read-ahead ring's buffers: each holds up to a whole layer's bundles
ROW_MAP_BYTES = 4 + 8          # per cache row: slot_of (int32) + last_use (int64)
WORK_FIXED = 10 * MiB          # activations, attention scratch, Python objects of a forward pass


@dataclass(frozen=True)
class BudgetPlan:
    """What stays resident, and the per-layer neuron cache the rest of the budget buys."""

    budget: int                       # bytes
    resident: dict                    # what -> bytes, everything but the neuron caches
    n_layers: int
    n_ff: int
    stride: int                       # the widest layer's bundle bytes (staging rows)
    strides: int                      # bytes of one slot in every layer: the layers' strides summed
    capacity: int                     # cache rows per layer
    n_pinned: int                     # of them pinned (slots 0 .. n_pinned-1)
    staging_rows: int                 # rows of the staging buffer
    notes: tuple = field(default=())
    streamed: tuple = field(default=())   # dense tensors read from dense.bin per use
    streamed_bytes: int = 0           # of them read per token (the embedding rows not counted)
    predictor: bool = False           # the manifest's predictor is resident (runtime's choice)
    expert_rows: int = 0              # rows (neurons) of one expert; 0: a dense FFN
    sparse_head: bool = False         # the head streams sparsely: its sketch resident, the
                                      # candidate rows read (runtime/sparse_head.py)
    draft_rows: int = 0               # output head rows a self draft holds (the head streams)

    @property
    def cache_bytes(self) -> int:
        return self.capacity * (self.strides + self.n_layers * ROW_MAP_BYTES) + \
            self.n_layers * 4 * self.n_ff

    @property
    def total(self) -> int:
        return sum(self.resident.values()) + self.cache_bytes

    @property
    def cache_fraction(self) -> float:
        """Share of the FFN the caches hold."""
        return self.capacity / self.n_ff

    def summary(self) -> str:
        mib = lambda n: format_size(n, "MiB", up=True)              # noqa: E731
        parts = ", ".join(f"{k} {mib(v)}" for k, v in self.resident.items())
        stream = f"; dense streamed: {_describe(self.streamed)} ({mib(self.streamed_bytes)} " \
                 f"per token)" if self.streamed else ""
        caches = f"({self.capacity} of {self.n_ff} neurons per layer = " \
            f"{self.cache_fraction:.0%}, {self.n_pinned} pinned)"
        if self.expert_rows:                  # whole experts: runtime/expert_ffn.py counts them
            caches = f"({self.capacity} of {self.n_ff} bundles per layer)"
        kind = "expert" if self.expert_rows else "neuron"
        return (f"DRAM budget {mib(self.budget)}: {parts}; {kind} caches {mib(self.cache_bytes)} "
                f"{caches}{stream}")


def _describe(names) -> str:
    """'attention of 20 layers, output head, embeddings' for a set of streamed tensor names."""
    layers = len({n.split(".")[1] for n in names if n.startswith("blk.")})
    parts = [f"attention of {layers} layers"] if layers else []
    parts += [w for n, w in (("output.weight", "output head"), ("token_embd.weight", "embeddings"))
              if n in names]
    return ", ".join(parts)


def process_rss(step: int = PROCESS_STEP) -> int:
    """Resident bytes of this process now (Linux /proc; 0 where unavailable), rounded up to a
    whole `step`: the measure moves by a few hundred KiB from run to run, and a plan that moved
    with it would size the caches a few neurons differently, so the FFN would sum in another
    order and `--temp 0` would not repeat its text."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        rss = pages * os.sysconf("SC_PAGE_SIZE")             # the OS's page, not the I/O PAGE
    except (OSError, IndexError, ValueError):
        return 0
    return -(-rss // step) * step


def model_bytes(manifest: dict) -> int:
    """Bytes of the converted model's weights: dense.bin + ffn.bin."""
    return int(manifest["dense"]["nbytes"]) + int(manifest["ffn"]["nbytes"])


def resident_bytes(manifest: dict, n_ctx: int, process: int, predictor: int,
                   reader_stage: int, stride_rows: int, keep_tokenizer: bool = False,
                   draft: int = 0) -> dict:
    """Everything but the dense matrices and the neuron caches, by what it is. keep_tokenizer:
    the tokenizers object stays loaded (chat encodes every turn), not released for good after
    the prompt is encoded. draft: the self draft's head rows and borrowed rows (resident.py)."""
    c = manifest["config"]
    kv = 2 * c["n_layers"] * n_ctx * c["n_kv_heads"] * c["head_dim"] * 2
    work = WORK_FIXED + 4 * 4 * c["vocab_size"] + reader_stage + stride_rows
    return {"KV cache": kv, "tokenizer": tokenizer_resident(manifest["tokenizer"], keep_tokenizer),
            "process": process, "buffers": work, "predictor": predictor,
            **({"draft": draft} if draft else {})}


def head_name(manifest: dict) -> str:
    """The output head's tensor name: output.weight, or token_embd.weight when tied."""
    names = {t["name"] for t in manifest["dense"]["tensors"]}
    return "output.weight" if "output.weight" in names else "token_embd.weight"


def packed_nbytes(entry: dict) -> int:
    """DRAM of a resident matrix (manifest entry) that DenseWeights(pack=True) repacks for this
    build's matmul: its bytes, or more (q4_k's packed layout is ~3% larger)."""
    shape = entry["shape"]
    packed = kernel.packed_nbytes(entry["dtype"], shape[0], shape[1]) if len(shape) == 2 else 0
    return max(int(entry["nbytes"]), int(packed))


def dense_groups(manifest: dict) -> tuple[int, list[tuple[list[str], int]], tuple[list[str], int]]:
    """(bytes always resident, [(names, bytes)] kept while the budget lasts in this order, the
    embeddings (names, bytes) kept last): vectors and small matrices; each layer's attention,
    then the output head; token_embd (the head too when tied). What does not fit is read every
    token either way (the bytes are equal, what DRAM is left goes to the neuron caches; both
    join a static pass's read stream: runtime/stream.py)."""
    entries = {t["name"]: t for t in manifest["dense"]["tensors"]}
    tensors = {n: int(t["nbytes"]) for n, t in entries.items()}
    head = head_name(manifest)
    h = entries[head]
    packs = [n for i in range(manifest["config"]["n_layers"]) for n in attn_names(i)] + \
        ([head] if head == "output.weight" or kernel.unpacks(h["dtype"], *h["shape"]) else [])
    # ^ what DenseWeights(pack) packs: a tied head when embed() can unpack its rows
    tensors.update({n: packed_nbytes(entries[n]) for n in packs if n in entries})
    groups = [(attn_names(i), sum(tensors[n] for n in attn_names(i)))
              for i in range(manifest["config"]["n_layers"])] + [([head], tensors[head])]
    embed = (["token_embd.weight"], tensors["token_embd.weight"]) if head == "output.weight" \
        else ([], 0)
    grouped = {n for names, _ in groups for n in names} | set(embed[0]) | set(SKETCH_NAMES)
    return sum(v for n, v in tensors.items() if n not in grouped), groups, embed


def stream_reserve(manifest: dict, n_ctx: int, streamed=None) -> int:
    """DRAM of the dense streaming buffers (runtime/weights.py) for the streamed tensor names
    (None: everything streams)."""
    entries = {t["name"]: t for t in manifest["dense"]["tensors"]}
    on = lambda name: streamed is None or name in streamed
    layer = max(aligned_offsets(entries[n]["nbytes"] for n in attn_names(i))[1]
                if on(attn_names(i)[0]) else 0 for i in range(manifest["config"]["n_layers"]))
    e = entries["token_embd.weight"]
    head = entries[head_name(manifest)]
    chunk = min(CHUNK_BYTES, head["nbytes"]) + 64 * (head["nbytes"] // head["shape"][0])
    return 2 * layer + 2 * chunk * on(head["name"]) + n_ctx * (e["nbytes"] // e["shape"][0]) \
        * on("token_embd.weight")


def plan_budget(manifest: dict, budget_given: Budget, n_ctx: int, process: int, predictor: int = 0,
                reader_stage: int = 0, naive: bool = False, pin_fraction: float = 0.5,
                keep_tokenizer: bool = False, draft: int = 0,
                sketch: tuple[int, int] = (0, 0)) -> BudgetPlan:
    """Keep dense weights, then size the neuron caches within budget_given (a Budget, parsed
    where it was given); BudgetError (one line) when it cannot work (check_budget). Arithmetic
    on the manifest (a Manifest, or its mapping) and the arguments: nothing read, nothing
    parsed. sketch: (resident bytes, bytes read a token) of a sparse head
    (sparse_head.sketch_bytes) when one may run; (0, 0): it may not."""
    f = manifest["ffn"]
    n_layers, n_ff, stride = int(f["n_layers"]), int(f["n_ff"]), int(f["stride"])
    strides = sum(layer_strides(f))                  # one slot of every layer
    budget, staging_rows, resident, fixed = _floor(manifest, budget_given, n_ctx, process,
                                                   predictor, reader_stage, naive,
                                                   keep_tokenizer, draft)
    always, groups, embed = dense_groups(manifest)
    dense_all = always + sum(b for _, b in groups) + embed[1]
    row = strides + n_layers * ROW_MAP_BYTES
    full_cache = 0 if naive else n_ff * row
    kept, streamed, left = dense_all, [], budget - fixed - (dense_all - always)
    sparse = False
    if left < full_cache:         # streaming what does not fit, or the embeddings, may read less
        stream = _stream_plan(manifest, n_ctx, budget - fixed, groups, embed)
        cheaper = stream is not None and _read_per_token(manifest, full_cache, stream, groups) \
            < ffn_reads(manifest, full_cache, left)
        if stream is not None and (left < 0 or cheaper):
            kept, streamed, left = always + stream[0], stream[1], stream[2]
        if not naive:
            cur = (kept - always, streamed, left)
            kept, streamed, left = _head_overlap(manifest, n_ctx, budget - fixed, groups, embed,
                                                 full_cache, cur)
            (kept, streamed, left), sparse = _sparse_head(
                manifest, n_ctx, budget - fixed, groups, embed, full_cache,
                (kept, streamed, left), sketch)
            kept += always
    capacity = 0 if naive else _cache_rows(manifest, min(n_ff, left // row))
    per_token = _streamed_bytes(groups, streamed)
    resident = {"dense weights": kept, **resident}
    if sparse:
        per_token += sketch[1] - groups[-1][1]
        resident["head sketch"] = sketch[0]
    if streamed:
        resident["stream buffers"] = stream_reserve(manifest, n_ctx, set(streamed))
    hot_first = f.get("neuron_order") is not None
    moe = bool(manifest["config"].get("n_experts"))       # the router picks: no neuron order
    pins = capacity if capacity == n_ff else int(capacity * pin_fraction) if hot_first else 0
    notes = () if hot_first or naive or moe else \
        _uncalibrated(head_name(manifest) in streamed and not sparse)
    return BudgetPlan(budget, resident, n_layers, n_ff, stride, strides, int(capacity), int(pins),
                      staging_rows, notes, tuple(streamed), per_token,
                      expert_rows=int(manifest["config"]["n_ff"]) if moe else 0,
                      sparse_head=sparse)


def check_budget(manifest: dict, budget_given: Budget, n_ctx: int, process: int,
                 predictor: int = 0, reader_stage: int = 0, naive: bool = False,
                 keep_tokenizer: bool = False, draft: int = 0, **_) -> None:
    """plan_budget's refusals alone, without a plan (the same arguments; BudgetError, the same
    line): the tokenizer's load, and what must stay resident — the process, the KV cache, the
    buffers, the dense vectors, and the dense matrices or the buffers streaming them."""
    _floor(manifest, budget_given, n_ctx, process, predictor, reader_stage, naive,
           keep_tokenizer, draft)


def _floor(manifest: dict, budget_given: Budget, n_ctx: int, process: int, predictor: int,
           reader_stage: int, naive: bool, keep_tokenizer: bool, draft: int) -> tuple:
    """(the budget's bytes, staging rows, what stays resident by name, its bytes with the dense
    vectors and the cache maps), or plan_budget's refusal."""
    f = manifest["ffn"]
    n_layers, n_ff, stride = int(f["n_layers"]), int(f["n_ff"]), int(f["stride"])
    budget, budget_text = budget_given.bytes_of(model_bytes(manifest)), budget_given.text
    staging_rows = min(RING_BUFFERS * n_ff, max(1, STAGING_BYTES // stride))
    resident = resident_bytes(manifest, n_ctx, process, predictor, reader_stage,
                              staging_rows * stride, keep_tokenizer, draft)
    always, groups, embed = dense_groups(manifest)
    dense_all = always + sum(b for _, b in groups) + embed[1]
    fixed = sum(resident.values()) + always + (0 if naive else 4 * n_ff * n_layers)
    check_tokenizer_load(manifest, budget, budget_text, process)
    reserve = stream_reserve(manifest, n_ctx)        # everything streamed: the least it takes
    if budget - fixed - (dense_all - always) < 0 and budget - fixed < reserve:
        refuse(budget, budget_text, {**resident, "dense vectors": always,
                                      "stream buffers": reserve}, fixed + reserve)
    return budget, staging_rows, resident, fixed


def _uncalibrated(whole_head: bool) -> tuple[str, ...]:
    """The note of a plan without calibrate's order (whole_head: the head streams whole)."""
    return ("not calibrated (run `flashllm calibrate` once): the caches hold the first neurons, "
            "not the most active" + ("; each token reads the whole output head, calibrate may "
                                     "let it read a sketch of it" if whole_head else ""),)


def ffn_reads(manifest: dict, full_cache: int, cache: int) -> float:
    """Bytes of FFN bundles a decode token reads when `cache` of the full_cache bytes go to the
    caches. Dense FFN: every byte missing (static reads; less with a predictor). A mixture of
    experts: the missing experts' bytes times n_experts_used / n_experts (a cache of c of a
    layer's E experts serves c / E of its routings when routing is uniform, its worst case),
    and the shared expert's in full (cached first: runtime/expert_ffn.py)."""
    miss, c = max(0, full_cache - cache), manifest["config"]
    if not c.get("n_experts"):
        return miss
    n_ff = int(manifest["ffn"]["n_ff"])
    experts = full_cache * (n_ff - int(c.get("n_ff_shared") or 0)) // n_ff
    return min(miss, experts) * c["n_experts_used"] / c["n_experts"] + max(0, miss - experts)


def _cache_rows(manifest: dict, rows: int) -> int:
    """Cache rows per layer to use of `rows`: a mixture of experts the shared expert's, then whole
    experts of n_ff rows (the rest would sit idle); a dense FFN all or whole blocks of the FFN
    kernel's sums (kernel.ffn_block), so a run's text does not depend on its caches' size."""
    c = manifest["config"]
    if not c.get("n_experts"):
        block = kernel.ffn_block()
        return rows if rows >= int(c["n_ff"]) else rows // block * block
    shared, n = int(c.get("n_ff_shared") or 0), int(c["n_ff"])
    return rows if rows < shared else shared + (rows - shared) // n * n


def _read_per_token(manifest: dict, full_cache: int, stream: tuple, groups: list) -> float:
    """Bytes a token reads under a stream plan: the FFN the caches miss (ffn_reads) plus the
    streamed matrices. For a dense FFN streaming a matrix to grow the caches never pays by this
    count (its stream buffers come off the caches too) — only what does not fit, the embeddings
    (one row per token) and, for the overlap of its compute with reads, the output head should
    stream; for a mixture of experts, whose cache bytes save k/E of a byte, the head stays."""
    return ffn_reads(manifest, full_cache, stream[2]) + _streamed_bytes(groups, stream[1])


def _streamed_bytes(groups: list, streamed) -> int:
    """Bytes of the dense groups read per token when the names streamed stream."""
    return sum(b for names, b in groups if names[0] in streamed)


def _head_overlap(manifest: dict, n_ctx: int, avail: int, groups: list, embed: tuple,
                  full_cache: int, cur: tuple) -> tuple:
    """cur (dense bytes kept, names streamed, bytes left for the caches), or the plan that
    streams the output head too when the caches can take the DRAM it frees. The bytes a token
    reads are then the same but for the head's two stream buffers, and the head's compute — the
    longest stretch of a token with nothing to read — overlaps the reads of its own extents
    instead of stalling the read-ahead ring once its buffers are full (docs/MEASUREMENTS.md,
    "The output head streamed")."""
    head = groups[-1][0][0]
    if head in cur[1]:
        return cur
    alt = _stream_plan(manifest, n_ctx, avail, groups, embed, stream_head=True)
    if alt is None:
        return cur
    buffers = stream_reserve(manifest, n_ctx, set(alt[1])) - \
        stream_reserve(manifest, n_ctx, set(alt[1]) - {head})     # the head's two chunks
    more = _read_per_token(manifest, full_cache, alt, groups) - \
        _read_per_token(manifest, full_cache, cur, groups)
    return alt if more <= buffers else cur


def _sparse_head(manifest: dict, n_ctx: int, avail: int, groups: list, embed: tuple,
                 full_cache: int, cur: tuple, sketch: tuple[int, int]) -> tuple[tuple, bool]:
    """(cur, False), or (the plan that streams the head sparsely, True) when a token then reads
    fewer bytes: the head streams, its sketch streams in its place through the same buffers, the
    candidate rows are read (sketch[1]: both, a token), and the sketch's error table and exact
    columns (sketch[0]) stay resident."""
    if not sketch[1]:
        return cur, False
    alt = _stream_plan(manifest, n_ctx, avail - sketch[0], groups, embed, stream_head=True)
    if alt is None:
        return cur, False
    sparse = ffn_reads(manifest, full_cache, alt[2]) + sketch[1] + \
        _streamed_bytes(groups, alt[1]) - groups[-1][1]
    if sparse >= _read_per_token(manifest, full_cache, cur, groups):
        return cur, False
    return alt, True


def _stream_plan(manifest: dict, n_ctx: int, avail: int, groups: list, embed: tuple,
                 stream_head: bool = False):
    """(dense bytes kept, names streamed, bytes left for the caches) when the groups are kept in
    order while they fit (the output head, the last group, streams anyway with stream_head) and
    the embeddings stream; None when even the buffers do not fit."""
    reserve = stream_reserve(manifest, n_ctx)
    if avail < reserve:
        return None
    kept, streamed, left = 0, [], avail - reserve
    for i, (names, nbytes) in enumerate(groups):
        if nbytes <= left and not (stream_head and i == len(groups) - 1):
            kept, left = kept + nbytes, left - nbytes
        else:
            streamed += names
    streamed += embed[0]
    return kept, streamed, left + reserve - stream_reserve(manifest, n_ctx, set(streamed))
