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

from flashllm.serve.api import ApiError, parse_ask
from flashllm.serve.ollama_app import OllamaRoutes
from flashllm.serve.relay import Events, collect, json_body
from flashllm.serve.responses import Chunks, new_id, response, usage
from flashllm.serve.worker import Busy, Job


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
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  *OllamaRoutes(self).routes()]
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
            self.check_key(request)
        except ApiError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_ids[0], "object": "model", "created": self.created,
             "owned_by": "flashllm"}]})

    async def chat(self, request: Request):
        return await self._generate(request, chat=True)

    async def completions(self, request: Request):
        return await self._generate(request, chat=False)

    def check_key(self, request: Request) -> None:
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
            self.check_key(request)
            ask = parse_ask(await json_body(request), chat, self.model_ids, self.max_tokens)
            events, job = await self.submit(request, ask)
        except ApiError as e:
            return error_response(e)
        except ClientDisconnect:
            return JSONResponse({}, status_code=499)
        rid, model = new_id(chat), self.model_ids[0]
        if ask.stream:
            return StreamingResponse(_sse(events, job, Chunks(ask, rid, model)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _whole(events, request, job, ask, rid, model)

    async def submit(self, request: Request, ask) -> tuple:
        """Queue ask's job and wait for it to start: (its Events, the Job); ApiError when the
        queue is full (503) or the job fails to start (its prompt: 400)."""
        events = Events(asyncio.get_running_loop())
        job = Job(ask, events.emit)
        try:
            self.worker.submit(job)
        except Busy as e:
            raise ApiError(503, str(e), kind="server_error", code="busy") from None
        await events.first(request, job)
        return events, job


async def _whole(events: Events, request: Request, job: Job, ask, rid: str, model: str):
    """A response of the whole answer, once it is done."""
    try:
        got = await collect(events, request, job)
    except ApiError as e:
        return error_response(e)
    pieces, entries, finish, counts = got
    return JSONResponse(response(ask, rid, model, "".join(pieces), finish, usage(*counts),
                                 entries))


async def _sse(events: Events, job: Job, chunks: Chunks):
    """The answer as server-sent events; the job is cancelled if the client goes away (the
    server cancels this generator) or the stream ends early."""
    def data(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
    try:
        for c in chunks.start():
            yield data(c)
        while True:
            event = await events.queue.get()
            if event[0] == "text":
                out = chunks.text(event[1])
            elif event[0] == "logprob":
                out = chunks.logprob(event[1])
            elif event[0] == "done":
                for c in chunks.done(event[1], tuple(event[2:])):
                    yield data(c)
                break
            else:
                yield data(event[1].body())
                break
            for c in out:
                yield data(c)
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()              # a no-op once the job is done
