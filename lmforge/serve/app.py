"""The HTTP layer: a FastAPI app over a :class:`~lmforge.serve.server.ServedModel` (:func:`create_app`).

Routes here: ``GET /`` (the web chat page, static files shipped in the package), ``GET /health``, ``GET
/v1/models``, ``POST /v1/embeddings``, ``POST /tokenize``, ``POST /detokenize`` and ``GET /metrics`` (Prometheus
text); the generation routes are :mod:`~lmforge.serve.chat_routes`' and :mod:`~lmforge.serve.response_routes`'.
``/health`` says the server is up and how busy it is, never what requests asked (counts of tokens, cache hits and
drafts are on ``/metrics``, behind the key). Every error has the OpenAI shape (a 500: :class:`_Unexpected`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import struct
import time
from importlib import resources
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmforge.serve import api
from lmforge.serve.access import AllowedHosts, HostCheck, Keys
from lmforge.serve.chat_routes import add_chat_routes
from lmforge.serve.errors import APIError, shown
from lmforge.serve.metrics import CONTENT_TYPE, Metrics
from lmforge.serve.response_routes import add_response_routes
from lmforge.serve.response_store import ResponseStore
from lmforge.serve.service import Service, endpoint

logger = logging.getLogger("lmforge")

__all__ = ["create_app"]

STATIC = resources.files("lmforge.serve") / "static"
_STATIC_TYPES = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
BODY_TIMEOUT_S = 30.0


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(served: Any, api_key: str | Sequence[str] | None = None, max_body: int = 1 << 20,
               body_timeout: float = BODY_TIMEOUT_S, allowed_hosts: Sequence[str] = (),
               response_store: ResponseStore | None = None) -> FastAPI:
    """The app serving ``served`` (a :class:`~lmforge.serve.server.ServedModel`); its lifespan starts and stops
    the scheduler's engine thread.

    ``api_key``: a key, or several (one per tenant, :class:`~lmforge.serve.access.Keys`), required as
    ``Authorization: Bearer KEY`` on ``/v1/*``, ``/tokenize``, ``/detokenize`` and ``/metrics`` (the page and
    ``/health`` stay open); ``ValueError`` for one that could never match (:func:`~lmforge.serve.access.check_api_key`).
    ``max_body`` and ``body_timeout``: a request body's bounds (:meth:`~lmforge.serve.service.Service.body`).
    ``allowed_hosts``: the host names a request's ``Host`` may carry besides ``localhost`` and IP addresses (others:
    400; :class:`~lmforge.serve.access.AllowedHosts`, which refuses a malformed one). ``response_store``: where
    ``/v1/responses`` keeps stored responses (default: a :class:`~lmforge.serve.response_store.ResponseStore`).
    """
    keys = None if api_key is None else Keys([api_key] if isinstance(api_key, str) else api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served.scheduler.start()
        try:
            yield
        finally:
            served.scheduler.stop()

    app = FastAPI(title="lmforge", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Unexpected, fail=lambda scope, e: _internal(Request(scope), e))  # (inner: added first)
    app.add_middleware(HostCheck, hosts=AllowedHosts(allowed_hosts))
    sched = served.scheduler
    store = response_store if response_store is not None else ResponseStore()

    def counts() -> dict[str, int]:  # (read on this event loop, when /metrics is scraped: the store's thread)
        return sched.load() | {"responses_stored": len(store), "responses_stored_bytes": store.bytes}

    metrics = Metrics(counts)
    svc = Service(served, keys, metrics, store, max_body, body_timeout)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        if e.status != 401:
            metrics.request(endpoint(request), e.status)
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        what = "no such route" if e.status_code == 404 else str(e.detail)
        metrics.request(endpoint(request), e.status_code)
        return _error(APIError(e.status_code, f"{shown(request.method + ' ' + request.url.path, 100)}: {what}",
                               code="not_found" if e.status_code == 404 else None))

    def _internal(request: Request, e: Exception) -> JSONResponse:
        logger.error("request failed", exc_info=e)
        metrics.request(endpoint(request), 500)
        return _error(APIError(500, f"internal error: {type(e).__name__}: {shown(e, 300, quote=False)}",
                               type="server_error"))

    # ---------------------------------------------------------------------------------------------
    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return await static("index.html")

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in _STATIC_TYPES:
            raise APIError(404, f"no static file {shown(name)}", code="not_found")
        with resources.as_file(STATIC / name) as path:
            return FileResponse(path, media_type=_STATIC_TYPES[name], headers={"Cache-Control": "no-cache"})

    @app.get("/health")
    async def health() -> dict[str, Any]:  # (what the page and a load balancer read)
        load = sched.load()  # rows decoding, requests waiting, and their limits
        return {"status": "ok", "model": served.model_id, "chat": served.chat is not None, "auth": keys is not None,
                "context_length": served.context_length,
                **{k: load[k] for k in ("active", "waiting", "max_batch", "max_queue")}}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        svc.authorize(request)
        svc.ok(request)
        return {"object": "list", "data": [_model_card(served.model_id)]}

    @app.get("/v1/models/{name}")
    async def model(name: str, request: Request) -> dict[str, Any]:
        svc.authorize(request)
        svc.check_model(name)
        svc.ok(request)
        return _model_card(name)

    add_chat_routes(app, svc)
    add_response_routes(app, svc)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict[str, Any]:
        _, req = await svc.read(request, api.EmbeddingRequest)
        inputs = []
        for k, x in enumerate(req.items()):
            ids = served.text_prompt(x) if isinstance(x, str) else list(x)
            if not ids or any(not 0 <= t < served.tokenizer.vocab_size for t in ids):
                raise APIError(400, f"input {k}: token ids must be in [0, {served.tokenizer.vocab_size})", "input")
            if len(ids) > served.context_length:
                raise APIError(400, f"input {k} has {len(ids)} tokens but the model's context length is "
                                    f"{served.context_length}; shorten it", "input", "context_length_exceeded")
            inputs.append(ids)
        vectors = await asyncio.to_thread(served.embed, inputs)
        data = [{"object": "embedding", "index": k,
                 "embedding": _base64(v) if req.encoding_format == "base64" else v} for k, v in enumerate(vectors)]
        n = sum(map(len, inputs))
        svc.ok(request)
        return {"object": "list", "data": data, "model": served.model_id,
                "usage": {"prompt_tokens": n, "total_tokens": n}}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        _, req = await svc.read(request, api.TokenizeRequest)
        if req.prompt is not None:
            ids = served.text_prompt(req.prompt) if req.prompt else []
        else:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = served.chat_prompt([m.as_chat() for m in req.messages], tools)
        svc.ok(request)
        return {"tokens": ids, "count": len(ids), "max_model_len": served.context_length}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        _, req = await svc.read(request, api.DetokenizeRequest)
        n = served.tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < n]
        if bad:
            raise APIError(400, f"token id {shown(bad[0])} is out of range [0, {n})", "tokens")
        svc.ok(request)
        return {"prompt": served.tokenizer.decode(req.tokens)}

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        svc.authorize(request)
        return Response(metrics.text(), headers={"Content-Type": CONTENT_TYPE})

    # ---------------------------------------------------------------------------------------------
    return app


class _Unexpected:
    """ASGI middleware: an exception that escaped the app before its response started is answered by
    ``fail(scope, exception)`` (the OpenAI-shaped 500), and the connection stays usable (the framework's own
    last resort re-raises it, and uvicorn then drops the connection without ``Connection: close``). After the
    response started (a stream), the exception goes on: the connection must close."""

    def __init__(self, app: Any, fail: Callable[[dict[str, Any], Exception], Response]) -> None:
        self.app, self.fail = app, fail

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        started = False

        async def watch(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            await self.app(scope, receive, watch)
        except Exception as e:  # noqa: BLE001
            if started:
                raise
            await self.fail(scope, e)(scope, receive, send)


def _base64(vector: list[float]) -> str:
    """An embedding as OpenAI's ``encoding_format: "base64"`` sends it: little-endian float32 bytes."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "lmforge"}
