"""What the routes share (serve/app.py's OpenAI ones, serve/ollama_app.py's Ollama ones): the
request body read within MAX_BODY, a job's events handed from the model's thread to the
request's event loop, and a whole answer collected from them."""
from __future__ import annotations

import asyncio
import time

from starlette.requests import ClientDisconnect, Request

from flashllm.limits import loads_json
from flashllm.serve.errors import ApiError

MAX_BODY = 4 << 20              # bytes of a request body


async def json_body(request: Request):
    """The request's JSON, read at most MAX_BODY bytes (413 past that, 400 when not JSON)."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY:
        raise ApiError(413, f"the request body is larger than {MAX_BODY >> 20} MiB")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY:
            raise ApiError(413, f"the request body is larger than {MAX_BODY >> 20} MiB")
    try:
        return loads_json(bytes(body))
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


class Events:
    """A job's events, handed from the worker thread to the request's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()
        self.first_ns = None            # time.monotonic_ns() of the first token's event

    def emit(self, event: tuple) -> None:
        if self.first_ns is None and event[0] in ("text", "logprob"):
            self.first_ns = time.monotonic_ns()
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:           # the loop is closed: the server is gone
            pass

    async def get(self, request: Request, job) -> tuple:
        """The next event; cancels the job when the client goes away while it waits."""
        while True:
            try:
                return await asyncio.wait_for(self.queue.get(), 0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancelled.set()
                    raise ClientDisconnect() from None

    async def first(self, request: Request, job) -> tuple:
        """The "start" event, or the ApiError the job failed with."""
        event = await self.get(request, job)
        if event[0] == "error":
            raise event[1]
        return event


async def collect(events: Events, request: Request, job) -> tuple:
    """The whole answer: (text pieces, logprob entries, finish_reason, (n_prompt, n_gen,
    n_cached)); ApiError when the job failed; the job is cancelled if the client goes away."""
    pieces, entries = [], []
    try:
        while True:
            event = await events.get(request, job)
            if event[0] == "text":
                pieces.append(event[1])
            elif event[0] == "logprob":
                entries.append(event[1])
            elif event[0] == "done":
                break
            else:
                raise event[1]
    except (ClientDisconnect, asyncio.CancelledError):
        job.cancelled.set()
        raise
    _, finish, *counts = event
    return pieces, entries, finish, tuple(counts)
