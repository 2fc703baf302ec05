"""The HTTP side: a Starlette app with OpenAI's routes over a Worker. Handlers check the request,
put a Job in the worker's queue and relay its events (as one JSON object, or as server-sent
events ending in `data: [DONE]`); they never touch the model. A client that goes away cancels
its job, which frees its slot at the next pass.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from flashllm.limits import loads_json
from flashllm.serve.api import ApiError, chunk, new_id, parse_ask, response, usage
from flashllm.serve.worker import Busy, Job

MAX_BODY = 4 << 20              # bytes of a request body


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class Server:
    """The routes over one worker: model_ids are the names a request's `model` may give (the
    first is the one /v1/models lists); api_key None: no key asked."""

    def __init__(self, worker, model_ids: tuple, api_key=None, max_tokens: int = 2048):
        self.worker, self.model_ids, self.api_key = worker, model_ids, api_key
        self.max_tokens = max_tokens
        self.created = int(time.time())

    def app(self, lifespan=None) -> Starlette:
        routes = [Route("/health", self.health, methods=["GET"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"])]
        return Starlette(routes=routes, lifespan=lifespan,
                         exception_handlers={HTTPException: self._http_error})

    async def _http_error(self, request: Request, exc: HTTPException) -> JSONResponse:
        """Unknown routes and methods in OpenAI's error shape."""
        what = "Unknown route" if exc.status_code == 404 else exc.detail
        return error_response(ApiError(exc.status_code, f"{what}: {request.method} "
                                       f"{request.url.path}", code="not_found"
                                       if exc.status_code == 404 else None))

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", **self.worker.counts()})

    async def models(self, request: Request) -> JSONResponse:
        try:
            self._check_key(request)
        except ApiError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_ids[0], "object": "model", "created": self.created,
             "owned_by": "flashllm"}]})

    async def chat(self, request: Request):
        return await self._generate(request, chat=True)

    async def completions(self, request: Request):
        return await self._generate(request, chat=False)

    def _check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 self.api_key.encode()):
            raise ApiError(401, "Incorrect API key provided", kind="invalid_request_error",
                           code="invalid_api_key")

    async def _generate(self, request: Request, chat: bool):
        try:
            self._check_key(request)
            ask = parse_ask(await _json_body(request), chat, self.model_ids, self.max_tokens)
            events = _Events(asyncio.get_running_loop())
            job = Job(ask, events.emit)
            try:
                self.worker.submit(job)
            except Busy as e:
                raise ApiError(503, str(e), kind="server_error", code="busy") from None
            await events.first(request, job)
        except ApiError as e:
            return error_response(e)
        except ClientDisconnect:
            return JSONResponse({}, status_code=499)
        rid, model = new_id(chat), self.model_ids[0]
        if ask.stream:
            return StreamingResponse(_sse(events, job, ask, rid, model),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _whole(events, request, job, ask, rid, model)


async def _json_body(request: Request):
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


class _Events:
    """A job's events, handed from the worker thread to the request's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def emit(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:           # the loop is closed: the server is gone
            pass

    async def get(self, request: Request, job: Job) -> tuple:
        """The next event; cancels the job when the client goes away while it waits."""
        while True:
            try:
                return await asyncio.wait_for(self.queue.get(), 0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancelled.set()
                    raise ClientDisconnect() from None

    async def first(self, request: Request, job: Job) -> tuple:
        """The "start" event, or the ApiError the job failed with."""
        event = await self.get(request, job)
        if event[0] == "error":
            raise event[1]
        return event


async def _whole(events: _Events, request: Request, job: Job, ask, rid: str, model: str):
    """A response of the whole answer, once it is done."""
    pieces = []
    try:
        while True:
            event = await events.get(request, job)
            if event[0] == "text":
                pieces.append(event[1])
            elif event[0] == "done":
                break
            else:
                return error_response(event[1])
    except (ClientDisconnect, asyncio.CancelledError):
        job.cancelled.set()
        raise
    _, finish, *counts = event
    return JSONResponse(response(ask, rid, model, "".join(pieces), finish, usage(*counts)))


async def _sse(events: _Events, job: Job, ask, rid: str, model: str):
    """The answer as server-sent events; the job is cancelled if the client goes away (the
    server cancels this generator) or the stream ends early."""
    def data(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
    try:
        if ask.chat:
            yield data(chunk(ask, rid, model, "", None, first=True))
        while True:
            event = await events.queue.get()
            if event[0] == "text":
                yield data(chunk(ask, rid, model, event[1], None))
            elif event[0] == "done":
                _, finish, *counts = event
                yield data(chunk(ask, rid, model, None, finish))
                if ask.include_usage:
                    yield data(chunk(ask, rid, model, None, None, use=usage(*counts)))
                break
            else:
                yield data(event[1].body())
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()              # a no-op once the job is done
