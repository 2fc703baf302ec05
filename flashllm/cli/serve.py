"""`flashllm serve`: an OpenAI-compatible HTTP server (flashllm/serve/), registered on cli.app."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from flashllm.cli.app import (MODEL_HELP, DEFAULT_THREADS, MAX_THREADS, cache_dir, choice,
                              command, err, fail, finite, model_path)
from flashllm.errors import FlashError
from flashllm.session.options import AUTO_DRAFT, DRAFT_KINDS, MAX_DRAFT

DraftKind = choice("DraftKind", DRAFT_KINDS)


@command
def serve(
    model: str = typer.Argument(..., help=MODEL_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (anything but a "
                             "loopback address without --api-key is open to the network)."),
    port: int = typer.Option(8080, "--port", min=1, max=65535, help="Port to listen on."),
    dram_budget: Optional[str] = typer.Option(
        None, "--dram-budget", help="Stream the FFN from flash within this DRAM (as `run`'s), "
        "holding every stream's KV cache."),
    parallel: int = typer.Option(4, "--parallel", "-np", min=1, max=64,
                                 help="Streams in flight (each with its own KV cache)."),
    ctx_size: int = typer.Option(2048, "-c", "--ctx-size", min=16, help="Context of each "
                                 "stream (prompt + answer)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Ask every /v1 request for "
                                          "`Authorization: Bearer KEY`."),
    threads: int = typer.Option(DEFAULT_THREADS, "-t", "--threads", min=1, max=MAX_THREADS,
                                help="Compute threads."),
    queue_size: int = typer.Option(32, "--queue-size", min=1, max=4096, help="Requests that "
                                   "may wait for a stream; past that, 503."),
    draft: Optional[int] = typer.Option(None, "--draft", min=0, max=MAX_DRAFT, help="Speculative "
                                        "decoding, as `run --draft`: each stream's pass checks "
                                        "up to N guessed tokens (a pass's rows shared fairly "
                                        "among the streams in it; 0: off). Default: under "
                                        f"--dram-budget, when the FFN streams, {AUTO_DRAFT} "
                                        "guesses of the model's resident part; else off."),
    draft_kind: Optional[DraftKind] = typer.Option(None, "--draft-kind", help="Where --draft's "
                                                   "guesses come from: lookup (the context's "
                                                   "n-grams; the default with --draft N) or "
                                                   "self (the model's resident part, under "
                                                   "--dram-budget)."),
    draft_p_min: float = typer.Option(0.5, "--draft-p-min", min=0.0, max=1.0, callback=finite,
                                      help="--draft-kind self: stop drafting after a guess the "
                                      "draft gives less than this probability."),
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (chat and completions, streamed or not)."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        fail("serve needs the `serve` extra: pip install 'flashllm[serve]' (starlette, uvicorn)")
    from flashllm.serve.main import Listen, is_loopback, serve as serve_engine
    from flashllm.serve.model import EngineSpec, open_engine
    from flashllm.session.options import parse_budget
    from flashllm.session.run import Drafting
    log = lambda m: err.print(m, markup=False, soft_wrap=True)          # noqa: E731
    budget = parse_budget(dram_budget) if dram_budget is not None else None   # one line if bad
    drafting = Drafting.asked(draft, draft_kind and draft_kind.value, budget is not None,
                              auto=True)
    if not host.strip():
        fail("--host is empty: give an address to listen on (0.0.0.0: every address)")
    if not is_loopback(host) and api_key is None:
        log(f"warning: serving on {host} without --api-key: anyone who reaches this address "
            "can use the model")
    path = model_path(model, apart=dram_budget is not None)
    name = Path(model).name.removesuffix(".gguf") if Path(model).exists() else model
    spec = EngineSpec(path, name, parallel, ctx_size, threads, budget,
                      calibrate="" if Path(model).is_dir() else model,   # ours: a name's, a .gguf's
                      drafting=drafting, p_min=draft_p_min)
    try:
        engine = open_engine(spec, cache_dir(), log)
    except FlashError as e:          # a size that counts every stream's context: say so
        if "least --dram-budget" not in str(e) and "of KV cache" not in str(e):
            raise
        fail(f"{e} — with --parallel {parallel} streams of --ctx-size {ctx_size} tokens each")
    try:
        serve_engine(engine, Listen(host, port, api_key, queue_size), log)
    finally:
        engine.close()
