"""The served model: one converted model opened once, planned for every stream's KV cache, with
its tokenizer, its chat template and one network per stream (each its own KV cache, all sharing
the FFN, the dense weights and the head). The one place the server assembles a run: the rest of
flashllm/serve/ sees only Engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

Log = Callable[[str], None]


@dataclass(frozen=True)
class EngineSpec:
    """What `serve` asks for: the converted folder, its name for the API, the streams in flight
    (parallel), each one's context (n_ctx), threads and the DRAM budget (None: all in DRAM)."""

    path: Path
    name: str
    parallel: int = 1
    n_ctx: int = 2048
    threads: int = 1
    dram_budget: Optional[str] = None


@dataclass
class Engine:
    """An opened model for the worker thread: the networks (one per stream), the tokenizer, the
    chat template, each stream's context and the flash parts to close."""

    name: str
    flash: object
    tok: object
    template: object
    nets: list
    n_ctx: int
    parts: list = field(default_factory=list)

    def close(self) -> None:
        for part in self.parts:
            if part is not None:
                part.close()


def open_engine(spec: EngineSpec, cache: Path, log: Log,
                calibrate: Optional[Callable[[Path, Log], bool]] = None) -> Engine:
    """Plan (the budget must hold every stream's KV cache: refused before anything loads,
    naming the least budget that works), calibrate once (calibrate: a models.toml model's own
    conversion), open, and build the tokenizer, the template and spec.parallel networks."""
    from flashllm.format.integrity import verify_on_first_load
    from flashllm.format.reader import open_flash
    from flashllm.generation.tokenizer import Tokenizer
    from flashllm.runtime.assemble import FlashOptions, make_parts, plan_run
    from flashllm.ffi.heap import trim_heap
    from flashllm.runtime.budget import process_rss
    _load_code()
    trim_heap()
    fopts = FlashOptions(spec.dram_budget, keep_tokenizer=True)
    kv_ctx = spec.n_ctx * spec.parallel       # the plan holds every stream's KV cache
    plan = plan_run(spec.path, fopts, kv_ctx, process_rss())
    if calibrate is not None and plan is not None and calibrate(spec.path, log):
        plan = plan_run(spec.path, fopts, kv_ctx, process_rss())
    flash = open_flash(spec.path)
    verify_on_first_load(flash)
    tok = Tokenizer.from_flash(flash, word_cache=True)
    ffn, weights, _ = make_parts(flash, fopts, plan, None, spec.threads, cache, log=log)
    nets = stream_nets(flash, ffn, weights, spec)
    return Engine(spec.name, flash, tok, chat_template(flash, tok), nets, nets[0].n_ctx,
                  [ffn, weights])


def stream_nets(flash, ffn, weights, spec: EngineSpec) -> list:
    """spec.parallel networks over one FFN and one set of dense weights (the first network's,
    where ffn or weights is None: all in DRAM), each with its own f16 KV cache of spec.n_ctx
    positions (as `run` keeps it)."""
    from flashllm.runtime.model import Model
    first = Model(flash, n_threads=spec.threads, n_ctx=spec.n_ctx, ffn=ffn, weights=weights,
                  kv_dtype="f16")
    return [first] + [Model(flash, n_threads=spec.threads, n_ctx=spec.n_ctx, ffn=first.ffn,
                            weights=first.w, kv_dtype="f16") for _ in range(spec.parallel - 1)]


def chat_template(flash, tok):
    """The model's chat template as `run -i` renders it (ChatML when the model has none)."""
    from flashllm.generation.chat_template import load_template
    cfg = flash.config
    bos = tok.hf.id_to_token(cfg.bos_token_id) if cfg.bos_token_id is not None else None
    eos = tok.hf.id_to_token(cfg.eos_token_ids[0]) if cfg.eos_token_ids else None
    return load_template(flash.chat_template, None, bos or "", eos or "", cfg.arch)[0]


def _load_code() -> None:
    """Import what serving loads once it has started, so the process size a --dram-budget plan
    measures already holds it (as `run` does)."""
    import numpy.ma  # noqa: F401
    import numpy.random  # noqa: F401
    import flashllm.generation.generate  # noqa: F401
    import flashllm.runtime.sparse_ffn  # noqa: F401
