"""Ollama's routes on the Starlette app (serve/app.py's Server): /api/chat and /api/generate
(NDJSON lines by default, one object with `stream: false`), /api/tags, /api/ps, /api/show,
/api/version and `GET /` ("Ollama is running", what clients probe). Errors are Ollama's
{"error": message}. With --api-key, every /api route but /api/version asks for it.
"""
from __future__ import annotations

import json

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from flashllm.serve import ollama
from flashllm.serve.api import parse_ask
from flashllm.serve.errors import ApiError
from flashllm.serve.relay import collect, json_body


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse({"error": e.message}, status_code=e.status)


class OllamaRoutes:
    """The routes over a serve/app.Server (its worker, model ids, key and token cap)."""

    def __init__(self, server):
        self.server = server
        self.names = ollama.names_of(server.model_ids[0])

    def routes(self) -> list:
        return [Route("/", self.root, methods=["GET", "HEAD"]),
                Route("/api/version", self.version, methods=["GET"]),
                Route("/api/tags", self.tags, methods=["GET"]),
                Route("/api/ps", self.ps, methods=["GET"]),
                Route("/api/show", self.show, methods=["POST"]),
                Route("/api/chat", self.chat, methods=["POST"]),
                Route("/api/generate", self.generate, methods=["POST"])]

    async def root(self, request: Request):
        return PlainTextResponse("Ollama is running")

    async def version(self, request: Request):
        return JSONResponse({"version": ollama.VERSION})

    def _engine(self):
        return self.server.worker.engine

    def _size(self) -> int:
        path = getattr(self._engine().flash, "path", None)
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file()) if path else 0

    async def tags(self, request: Request):
        return await self._guard(request, lambda: {"models": [self._entry()]})

    async def ps(self, request: Request):
        def listing():
            return {"models": [{**self._entry(), "expires_at": "0001-01-01T00:00:00Z",
                                "size_vram": 0}]}
        return await self._guard(request, listing)

    def _entry(self) -> dict:
        return ollama.model_entry(self.server.model_ids[0], self._size(),
                                  self._engine().flash.config.arch)

    async def show(self, request: Request):
        try:
            self.server.check_key(request)
            ollama.check_model(await json_body(request), self.names)
        except ApiError as e:
            return _error(e)
        eng = self._engine()
        arch = eng.flash.config.arch
        return JSONResponse({
            "modelfile": "", "parameters": "", "template": eng.template.source,
            "details": ollama.details(arch), "modified_at": ollama.stamp(),
            "model_info": {"general.architecture": arch, f"{arch}.context_length": eng.n_ctx},
            "capabilities": ["completion"] + (["tools"] if _takes_tools(eng) else [])})

    async def _guard(self, request: Request, make):
        try:
            self.server.check_key(request)
        except ApiError as e:
            return _error(e)
        return JSONResponse(make())

    async def chat(self, request: Request):
        return await self._answer(request, chat_route=True)

    async def generate(self, request: Request):
        return await self._answer(request, chat_route=False)

    async def _answer(self, request: Request, chat_route: bool):
        srv = self.server
        try:
            srv.check_key(request)
            body = await json_body(request)
            cap = srv.max_tokens
            if chat_route:
                openai_body, chat = ollama.chat_body(body, self.names, cap), True
            else:
                openai_body, chat = ollama.generate_body(body, self.names, cap)
                if not body.get("prompt"):          # Ollama's "load the model" request
                    return JSONResponse({"model": body["model"], "created_at": ollama.stamp(),
                                         "response": "", "done": True, "done_reason": "load"})
            ask = parse_ask(openai_body, chat, srv.model_ids, cap)
            lines = ollama.Lines(body["model"], chat_route, ask.tools.names if ask.tools
                                 is not None and ask.tools.parse else None)
            events, job = await srv.submit(request, ask)
            if not ask.stream:
                pieces, entries, finish, counts = await collect(events, request, job)
                return JSONResponse(lines.whole(pieces, entries, finish, counts,
                                                events.first_ns))
        except ApiError as e:
            return _error(e)
        except ClientDisconnect:
            return JSONResponse({}, status_code=499)
        return StreamingResponse(_ndjson(events, job, lines), media_type="application/x-ndjson")


async def _ndjson(events, job, lines: "ollama.Lines"):
    """The answer as NDJSON lines; the job is cancelled if the client goes away."""
    def line(obj) -> str:
        return json.dumps(obj, ensure_ascii=False) + "\n"
    try:
        while True:
            event = await events.queue.get()
            lines.t_first = lines.t_first or events.first_ns
            if event[0] == "text":
                for obj in lines.text(event[1]):
                    yield line(obj)
            elif event[0] == "logprob":
                lines.logprob(event[1])
            elif event[0] == "done":
                for obj in lines.done(event[1], tuple(event[2:])):
                    yield line(obj)
                break
            elif event[0] == "error":
                yield line({"error": event[1].message})
                break
    finally:
        job.cancelled.set()


def _takes_tools(eng) -> bool:
    """Whether the model's template renders tools (what it renders with one differs)."""
    from flashllm.generation.chat_template import ChatError
    probe = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "probe", "parameters": {"type": "object"}}}
    try:
        return eng.template.render(probe, tools=[tool]) != eng.template.render(probe)
    except ChatError:
        return False
