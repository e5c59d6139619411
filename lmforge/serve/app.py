"""The HTTP layer: a FastAPI app over a :class:`~lmforge.serve.server.ServedModel`. It only calls the scheduler.

Routes: ``GET /`` (the web chat page, static files shipped in the package), ``GET /health``, ``GET /v1/models``,
``POST /v1/chat/completions``, ``POST /v1/completions``. A request is turned into prompt ids, submitted to the
scheduler (which runs the engine in its own thread) and answered from the updates the engine thread hands to
this event loop (``call_soon_threadsafe``): as one JSON object, or streamed as server-sent events
(``data: {chunk}`` lines, then ``data: [DONE]``). A client that goes away cancels its request, which frees
its row at the next step (or its place in the queue at once): a stream notices when it can no longer send, a
plain request by watching the connection while it waits. A request body must arrive within ``body_timeout``
seconds (else 408, and the connection is closed). Every error has the OpenAI shape
``{"error": {message, type, param, code}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from importlib import resources
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmforge.generate.scheduler import QueueFull, Update
from lmforge.generate.scheduler import Request as Job
from lmforge.serve import api
from lmforge.serve.api import APIError, ChatCompletionRequest, CompletionRequest
from lmforge.serve.server import check_api_key

logger = logging.getLogger("lmforge")

__all__ = ["create_app"]

STATIC = resources.files("lmforge.serve") / "static"
_STATIC_TYPES = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
RETRY_AFTER_S = 1
BODY_TIMEOUT_S = 30.0
CLOSE = {"Connection": "close"}  # a slow body's 408: the connection closes, the rest is never read


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(served: Any, api_key: str | None = None, max_body: int = 1 << 20,
               body_timeout: float = BODY_TIMEOUT_S) -> FastAPI:
    """The app serving ``served`` (a :class:`~lmforge.serve.server.ServedModel`).

    ``api_key``: required as ``Authorization: Bearer KEY`` on ``/v1/*`` (the page and ``/health`` stay open);
    ``ValueError`` if it could never match (:func:`~lmforge.serve.server.check_api_key`). ``max_body``: the
    largest request body in bytes (beyond: 413). ``body_timeout``: seconds a request body may take to arrive
    (beyond: 408, connection closed). The app's lifespan starts and stops the scheduler's engine thread.
    """
    if api_key is not None:
        check_api_key(api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served.scheduler.start()
        try:
            yield
        finally:
            served.scheduler.stop()

    app = FastAPI(title="lmforge", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    sched = served.scheduler

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        what = "no such route" if e.status_code == 404 else str(e.detail)
        return _error(APIError(e.status_code, f"{request.method} {request.url.path}: {what}",
                               code="not_found" if e.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        logger.exception("request failed")
        return _error(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' with the "
                                "key the server was started with", code="invalid_api_key")

    async def body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body:
            raise APIError(413, f"the request body has {declared} bytes, over this server's limit of {max_body}",
                           code="request_too_large")
        chunks, size = [], 0
        try:
            async with asyncio.timeout(body_timeout):  # a client trickling its body does not hold a connection
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > max_body:
                        raise APIError(413, f"the request body is over this server's limit of {max_body} bytes",
                                       code="request_too_large")
                    chunks.append(chunk)
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {body_timeout:g} s ({size} bytes came); "
                                "send it at once", code="request_timeout", headers=CLOSE) from None
        return b"".join(chunks)

    def check_model(name: str) -> None:
        if name != served.model_id:
            raise APIError(404, f"model {name!r} does not exist; this server serves {served.model_id!r} "
                                "(see GET /v1/models)", "model", "model_not_found")

    # ---------------------------------------------------------------------------------------------
    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return await static("index.html")

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in _STATIC_TYPES:
            raise APIError(404, f"no static file {name!r}", code="not_found")
        with resources.as_file(STATIC / name) as path:
            return FileResponse(path, media_type=_STATIC_TYPES[name], headers={"Cache-Control": "no-cache"})

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": served.model_id, "chat": served.chat is not None,
                "auth": api_key is not None, "context_length": served.context_length, **sched.load()}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        await authorize(request)
        return {"object": "list", "data": [_model_card(served.model_id)]}

    @app.get("/v1/models/{name}")
    async def model(name: str, request: Request) -> dict[str, Any]:
        await authorize(request)
        check_model(name)
        return _model_card(name)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        await authorize(request)
        req = api.parse(ChatCompletionRequest, await body(request))
        check_model(req.model)
        prompt = served.chat_prompt([{"role": m.role, "content": m.text()} for m in req.messages])
        limit = served.max_tokens(req.limit(), len(prompt), "messages")
        job = _job(req, prompt, limit, served.chat_stops(), served.chat_tool(), served.tool_text)
        return await _answer(request, job, req, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        await authorize(request)
        req = api.parse(CompletionRequest, await body(request))
        check_model(req.model)
        prompt = served.text_prompt(req.text())
        limit = served.max_tokens(req.limit(), len(prompt), "prompt")
        stops = [] if served.eot_id is None else [served.eot_id]
        return await _answer(request, _job(req, prompt, limit, stops, None), req, "text")

    # ---------------------------------------------------------------------------------------------
    def _job(req: Any, prompt: list[int], limit: int, stop_ids: list[int],
             tool: Callable[[int], list[int] | None] | None, token_text: dict[int, str] | None = None) -> Job:
        try:
            return Job(prompt, limit, _noop, temperature=req.temperature,
                       top_p=None if req.top_p >= 1 else req.top_p, seed=req.seed, stop_ids=stop_ids,
                       stop=req.stops(), tool=tool, token_text=token_text or {})
        except ValueError as e:  # a value the schema let through but the engine refuses
            raise APIError(400, str(e)) from None

    async def _answer(request: Request, job: Job, req: Any, kind: str) -> Response:
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[Update | None] = asyncio.Queue()  # None: the client went away
        job.emit = lambda u: loop.call_soon_threadsafe(updates.put_nowait, u)
        try:
            sched.submit(job)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except QueueFull as e:
            raise APIError(429, f"the server is busy: {e}", code="rate_limit_exceeded", type="rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except RuntimeError as e:  # stopping
            raise APIError(503, f"the server is shutting down ({e})", type="server_error") from None
        rid = api.new_id("chatcmpl" if kind == "chat" else "cmpl")
        if req.stream:
            return StreamingResponse(_stream(job, updates, rid, kind, req.include_usage()),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text, last = [], None
        watcher = asyncio.create_task(_watch(request, job, updates))
        try:
            while last is None:
                u = await updates.get()
                if u is None:  # cancelled by the watcher
                    return Response(status_code=499)
                text.append(u.text)
                if u.finish_reason is not None:
                    last = u
        finally:
            watcher.cancel()
            if last is None:
                sched.cancel(job)
        if last.finish_reason in ("error", "cancelled"):
            raise APIError(500, last.error or "the request was cancelled: the server is stopping", type="server_error")
        body = (api.chat_completion(rid, served.model_id, "".join(text), last.finish_reason, last.prompt_tokens,
                                    last.completion_tokens) if kind == "chat" else
                api.completion(rid, served.model_id, "".join(text), last.finish_reason,
                               api.usage(last.prompt_tokens, last.completion_tokens)))
        return JSONResponse(body)

    async def _watch(request: Request, job: Job, updates: asyncio.Queue[Update | None]) -> None:
        """Cancel ``job`` as soon as its client disconnects (the body is read: the next message the server
        gives is the disconnect), however busy its row is; then wake the request's reader."""
        try:
            while (await request.receive())["type"] != "http.disconnect":
                await asyncio.sleep(0.05)  # (a server that answers anything else: look again, without spinning)
        except Exception:  # noqa: BLE001  (the connection broke while waiting: gone as well)
            pass
        sched.cancel(job)
        updates.put_nowait(None)

    async def _stream(job: Job, updates: asyncio.Queue[Update | None], rid: str, kind: str,
                      include_usage: bool) -> AsyncIterator[bytes]:
        model_id, finished = served.model_id, False

        def chunk(text: str, finish: str | None = None, use: dict[str, int] | None = None,
                  choices: bool = True) -> bytes:
            if kind == "chat":
                return api.sse(api.chat_chunk(rid, model_id, {"content": text} if text else {}, finish, use, choices))
            return api.sse(api.completion(rid, model_id, text, finish, use, choices))

        try:
            if kind == "chat":
                yield api.sse(api.chat_chunk(rid, model_id, {"role": "assistant", "content": ""}))
            while True:
                if not updates.empty():  # a burst: let the loop notice a client that left before writing again
                    await asyncio.sleep(0)  # (asyncio logs a warning for every write to a lost connection)
                u = await updates.get()
                assert u is not None  # (only the non-streaming watcher sends None)
                if u.finish_reason in ("error", "cancelled"):
                    finished = True
                    msg = u.error or "the request was cancelled: the server is stopping"
                    yield api.sse(api.error_body(msg, "server_error"))
                    break
                if u.finish_reason is None:
                    if u.text:
                        yield chunk(u.text)
                    continue
                finished = True
                if u.text:
                    yield chunk(u.text)
                use = api.usage(u.prompt_tokens, u.completion_tokens)
                yield chunk("", u.finish_reason, use)
                if include_usage:
                    yield chunk("", None, use, choices=False)
                break
            yield api.SSE_DONE
        finally:
            if not finished:  # the client went away (or the server is stopping): free the row now
                sched.cancel(job)

    return app


def _noop(update: Update) -> None:
    """Placeholder ``emit`` until the request is bound to its event loop."""


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "lmforge"}
