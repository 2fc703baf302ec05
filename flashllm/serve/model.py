"""The served model: one converted model assembled by the session layer (as `run` assembles
it), planned for every stream's KV cache, with its tokenizer, its chat template and one network
per stream (each its own KV cache, all sharing the FFN, the dense weights and the head). The
rest of flashllm/serve/ sees only Engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

Log = Callable[[str], None]


@dataclass(frozen=True)
class EngineSpec:
    """What `serve` asks for: the converted folder, its name for the API, the streams in flight
    (parallel), each one's context (n_ctx), threads, the DRAM budget (a runtime Budget; None:
    all in DRAM) and the model as the user named it when its conversion is ours (calibrated
    once under a budget, as `run` does; "": a folder the user gave), the drafting asked
    (session Drafting; None: none) and a self draft's --draft-p-min."""

    path: Path
    name: str
    parallel: int = 1
    n_ctx: int = 2048
    threads: int = 1
    dram_budget: object = None
    calibrate: str = ""
    drafting: object = None
    p_min: float = 0.5


@dataclass
class Engine:
    """An opened model for the worker thread: the networks (one per stream), the tokenizer, the
    chat template, each stream's context, the assembled run to close and its drafting
    (session StreamDrafts; None: off)."""

    name: str
    flash: object
    tok: object
    template: object
    nets: list
    n_ctx: int
    parts: object = None
    lean: bool = False            # under a DRAM budget: grammars' token table without slices
    drafts: object = None
    _env: object = None

    def token_env(self):
        """The model's token table for response_format grammars (generation/grammar.py),
        built once, at the first request that has one (the worker's thread)."""
        if self._env is None:
            from flashllm.generation.grammar import token_env
            cfg = self.flash.config
            self._env = token_env(self.tok, cfg.vocab_size, cfg.bos_token_id, self.lean)
        return self._env

    def forget_records(self) -> None:
        """Drop the FFN's per-pass --stats records (they would grow with every pass)."""
        self.nets[0].ffn.forget_records()

    def close(self) -> None:
        if self.parts is not None:
            self.parts.close()


def open_engine(spec: EngineSpec, cache: Path, log: Log) -> Engine:
    """The run assembled by the session layer with a network per stream (its plan holds every
    stream's KV cache: a budget that cannot is refused before anything loads, naming the least
    that can), all over one FFN, one set of dense weights and one head; each stream drafts
    as `run` would (the plan holds every stream's self draft). With llguidance installed, the
    plan also sets aside the one token table response_format's grammars share (built at the
    first request that has one: Engine.token_env)."""
    from flashllm.generation.grammar import installed
    from flashllm.runtime.plan import AUTO_ROWS, FlashOptions
    from flashllm.session.run import Drafting, RunRequest, StreamDrafts, assemble
    drafting = spec.drafting or Drafting(0, "lookup")
    fopts = FlashOptions(spec.dram_budget, keep_tokenizer=True,
                         draft_rows=AUTO_ROWS if drafting.is_self else 0)
    req = RunRequest(spec.path, fopts, None, spec.threads, spec.n_ctx, drafting, AUTO_ROWS,
                     None, spec.calibrate, streams=spec.parallel, constrained=installed())
    parts = assemble(req, cache, log)
    try:
        drafts = StreamDrafts(parts, spec.p_min) if parts.drafting.n else None
    except BaseException:
        parts.close()
        raise
    return Engine(spec.name, parts.flash, parts.tok, chat_template(parts.flash, parts.tok),
                  parts.nets, parts.net.n_ctx, parts,
                  lean=spec.dram_budget is not None, drafts=drafts)


def drafting_note(engine: Engine) -> str:
    """How the streams draft, for the server's first line."""
    d = engine.drafts.drafting if engine.drafts is not None else None
    return f"drafting: {d.kind}, up to {d.n} guesses a pass" if d is not None else "no drafting"


def chat_template(flash, tok):
    """The model's chat template as `run -i` renders it (ChatML when the model has none)."""
    from flashllm.generation.chat_template import load_template
    cfg = flash.config
    bos = tok.hf.id_to_token(cfg.bos_token_id) if cfg.bos_token_id is not None else None
    eos = tok.hf.id_to_token(cfg.eos_token_ids[0]) if cfg.eos_token_ids else None
    return load_template(flash.chat_template, None, bos or "", eos or "", cfg.arch)[0]
