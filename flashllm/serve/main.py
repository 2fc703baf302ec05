"""Serving an opened Engine over HTTP with uvicorn until SIGTERM or Ctrl-C.

Shutdown (either signal): the listening socket closes at once (no new connection); requests in
flight get up to `grace` seconds to finish, then their connections are closed and their jobs
cancelled; queued jobs that never started get a 503; the model's thread ends; the process
exits with code 0.
"""
from __future__ import annotations

import contextlib
import signal
from dataclasses import dataclass
from typing import Callable, Optional

from flashllm.serve.model import drafting_note
from flashllm.serve.worker import Worker

Log = Callable[[str], None]


@dataclass(frozen=True)
class Listen:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: Optional[str] = None
    queue_size: int = 32
    grace: float = 10.0                  # seconds in-flight requests get to finish on shutdown


def is_loopback(host: str) -> bool:
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(engine, listen: Listen, log: Log) -> None:
    """Run the worker and the HTTP server until a signal stops them."""
    import uvicorn
    from flashllm.serve.app import Server
    worker = Worker(engine, queue_size=listen.queue_size)
    ids = tuple(dict.fromkeys((engine.name,)))
    server = Server(worker, ids, listen.api_key, max_tokens=engine.n_ctx)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        log(f"serving {engine.name} on http://{listen.host}:{listen.port} "
            f"({len(engine.nets)} streams of {engine.n_ctx} tokens; {drafting_note(engine)})")
        yield
        worker.stop()

    config = uvicorn.Config(server.app(lifespan), host=listen.host, port=listen.port,
                            log_level="warning", timeout_graceful_shutdown=listen.grace,
                            limit_concurrency=listen.queue_size + 64, access_log=False)
    _QuietServer(config).run()
    log("stopped")


class _QuietServer:
    """A uvicorn.Server that stops on SIGINT / SIGTERM without raising the signal again
    afterwards (uvicorn's own re-raises it once it has shut down)."""

    def __new__(cls, config):
        import uvicorn

        class Quiet(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                old = {s: signal.signal(s, self.handle_exit)
                       for s in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for s, handler in old.items():
                        signal.signal(s, handler)
        return Quiet(config)
