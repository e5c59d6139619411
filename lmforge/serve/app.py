"""The HTTP layer: a FastAPI app over a :class:`~lmforge.serve.server.ServedModel`. It only calls the scheduler.

Routes: ``GET /`` (the web chat page, static files shipped in the package), ``GET /health``, ``GET /v1/models``,
``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses`` (the Responses API, answered
through the chat path; ``GET``/``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``),
``POST /v1/embeddings``, ``POST /tokenize``, ``POST /detokenize`` and ``GET /metrics`` (Prometheus text). A request is turned into prompt ids, submitted to the
scheduler (which runs the engine in its own thread) and answered from the updates the engine thread hands to
this event loop (``call_soon_threadsafe``): as one JSON object, or streamed as server-sent events
(``data: {chunk}`` lines, then ``data: [DONE]``). A client that goes away cancels its request, which frees
its row at the next step (or its place in the queue at once): a stream notices when it can no longer send, a
plain request by watching the connection while it waits. A request body must arrive within ``body_timeout``
seconds (else 408, and the connection is closed). API POST bodies must be sent as ``application/json`` (else
415) and a request's ``Host`` must be one this server answers (:mod:`~lmforge.serve.access`, else 400): no
cross-site page can post to it, by a simple request or by DNS rebinding. Every error has the OpenAI shape
``{"error": {message, type, param, code}}``; after a 500 the keep-alive connection stays usable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from importlib import resources
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmforge.generate.scheduler import QueueFull, Update
from lmforge.generate.scheduler import Request as Job
from lmforge.serve import api, response_events, responses, structured
from lmforge.serve.api import APIError, ChatCompletionRequest, CompletionRequest, shown
from lmforge.serve.choices import Choice, Timing
from lmforge.serve.response_events import ResponseBuilder
from lmforge.serve.response_store import ResponseStore, Stored
from lmforge.serve.access import AllowedHosts, HostCheck, check_api_key, key_matches
from lmforge.serve.metrics import CONTENT_TYPE, Metrics

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
               body_timeout: float = BODY_TIMEOUT_S, allowed_hosts: AllowedHosts | Sequence[str] = (),
               response_store: ResponseStore | None = None) -> FastAPI:
    """The app serving ``served`` (a :class:`~lmforge.serve.server.ServedModel`).

    ``api_key``: required as ``Authorization: Bearer KEY`` on ``/v1/*`` (the page and ``/health`` stay open);
    ``ValueError`` if it could never match (:func:`~lmforge.serve.access.check_api_key`). ``max_body``: the
    largest request body in bytes (beyond: 413). ``body_timeout``: seconds a request body may take to arrive
    (beyond: 408, connection closed). ``allowed_hosts``: the host names a request's ``Host`` may carry besides
    ``localhost`` and IP addresses (others: 400; ``*``: any; :class:`~lmforge.serve.access.AllowedHosts`).
    API POST bodies must come as ``Content-Type: application/json`` (else 415), which a cross-site page cannot
    send without the CORS preflight this server never grants. ``response_store``: where ``/v1/responses`` keeps
    stored responses (default: a :class:`~lmforge.serve.response_store.ResponseStore` with its default bounds).
    The app's lifespan starts and stops the scheduler's engine thread.
    """
    if api_key is not None:
        check_api_key(api_key)
    hosts = allowed_hosts if isinstance(allowed_hosts, AllowedHosts) else AllowedHosts(allowed_hosts)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served.scheduler.start()
        try:
            yield
        finally:
            served.scheduler.stop()

    app = FastAPI(title="lmforge", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Unexpected, fail=lambda scope, e: _internal(Request(scope), e))  # (inner: added first)
    app.add_middleware(HostCheck, hosts=hosts)
    sched = served.scheduler
    metrics = Metrics(sched.load)
    store = response_store if response_store is not None else ResponseStore()

    def _bytes(t: int) -> bytes:
        return served.tokenizer.decode_bytes([t])

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        if e.status != 401:
            metrics.request(_endpoint(request), e.status)
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        what = "no such route" if e.status_code == 404 else str(e.detail)
        metrics.request(_endpoint(request), e.status_code)
        return _error(APIError(e.status_code, f"{shown(request.method + ' ' + request.url.path, 100)}: {what}",
                               code="not_found" if e.status_code == 404 else None))

    def _internal(request: Request, e: Exception) -> JSONResponse:
        logger.error("request failed", exc_info=e)
        metrics.request(_endpoint(request), 500)
        return _error(APIError(500, f"internal error: {type(e).__name__}: {shown(e, 300, quote=False)}",
                               type="server_error"))

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        if not key_matches(request.headers.get("authorization", ""), api_key):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' with the "
                                "key the server was started with", code="invalid_api_key")

    async def body(request: Request) -> bytes:
        kind = request.headers.get("content-type", "")
        if kind.partition(";")[0].strip().lower() != "application/json":
            raise APIError(415, f"the request body must be JSON sent with 'Content-Type: application/json' (this "
                                f"one came with {shown(kind) if kind else 'none'})", code="unsupported_media_type")
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
            raise APIError(404, f"model {shown(name)} does not exist; this server serves {served.model_id!r} "
                                "(see GET /v1/models)", "model", "model_not_found")

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
        return await _answer(request, await _chat_jobs(req), req, "chat")

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        await authorize(request)
        req = api.parse(responses.ResponseRequest, await body(request))
        check_model(req.model)
        previous = _stored(req.previous_response_id, "previous_response_id") if req.previous_response_id else None
        messages = responses.conversation(req, previous.history if previous is not None else [])
        with responses.renamed_errors():  # (the chat path's errors, with the Responses names)
            jobs = await _chat_jobs(responses.chat_request(req, messages))
        builder = ResponseBuilder(responses.new_id("resp"), served.model_id, req, _bytes)
        updates, timing = _submit(jobs)
        endpoint, job = _endpoint(request), jobs[0]

        def take(u: Update) -> list[Any]:
            failed = structured.constraint_failure(job) if u.finish_reason == "error" else None
            if failed is not None:
                raise responses.renamed(failed)
            return builder.add(u, lambda: structured.cut_call(job))

        def done(b: ResponseBuilder) -> None:
            failed = b.error["code"] if b.error is not None else None
            metrics.request(endpoint, 200 if failed is None else 500 if failed == "server_error" else 400)
            if b.usage is not None:
                metrics.tokens(b.usage["input_tokens"], b.usage["output_tokens"])
            if req.store and b.status != "failed":
                calls = b.calls()
                reply = {"role": "assistant", "content": b.text(), **({"tool_calls": calls} if calls else {})}
                store.put(b.rid, b.resource(), [*messages, reply], responses.input_items(req))

        if req.stream:
            def timed(u: Update) -> list[Any]:
                timing.update(0, u)
                return take(u)

            events = response_events.stream(builder, updates, timed, lambda: sched.cancel(job), done)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        if not await _collect(request, jobs, updates, timing, lambda k, u: take(u)):
            return Response(status_code=499)
        if builder.status == "failed":
            raise APIError(500, builder.error["message"] if builder.error else "failed", type="server_error")
        done(builder)
        return JSONResponse(builder.resource())

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> dict[str, Any]:
        await authorize(request)
        return _stored(response_id, "response_id").resource

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, request: Request) -> dict[str, Any]:
        await authorize(request)
        return responses.items_page(_stored(response_id, "response_id").inputs, request.query_params)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        await authorize(request)
        if not store.delete(response_id):
            _stored(response_id, "response_id")  # (raises its 404)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        await authorize(request)
        req = api.parse(CompletionRequest, await body(request))
        check_model(req.model)
        prompt = served.text_prompt(req.text())
        limit = served.max_tokens(req.limit(), len(prompt), "prompt", req.n)
        stops = [] if served.eot_id is None else [served.eot_id]
        return await _answer(request, [_job(req, prompt, limit, stops, None, None, k) for k in range(req.n)], req, "text")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict[str, Any]:
        await authorize(request)
        req = api.parse(api.EmbeddingRequest, await body(request))
        check_model(req.model)
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
        metrics.request("/v1/embeddings", 200)
        return {"object": "list", "data": data, "model": served.model_id,
                "usage": {"prompt_tokens": n, "total_tokens": n}}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        await authorize(request)
        req = api.parse(api.TokenizeRequest, await body(request))
        if req.model is not None:
            check_model(req.model)
        if req.prompt is not None:
            ids = served.text_prompt(req.prompt) if req.prompt else []
        else:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = served.chat_prompt([_message(m) for m in req.messages], tools)
        return {"tokens": ids, "count": len(ids), "max_model_len": served.context_length}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        await authorize(request)
        req = api.parse(api.DetokenizeRequest, await body(request))
        if req.model is not None:
            check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < served.tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"token id {shown(bad[0])} is out of range [0, {served.tokenizer.vocab_size})", "tokens")
        return {"prompt": served.tokenizer.decode(req.tokens)}

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        await authorize(request)
        return Response(metrics.text(), headers={"Content-Type": CONTENT_TYPE})

    # ---------------------------------------------------------------------------------------------
    def _stored(rid: str, param: str) -> Stored:
        found = store.get(rid)
        if found is None:
            raise APIError(404, f"no stored response has id {shown(rid)} (responses are kept in memory for "
                                f"{store.ttl:g} s, {store.max_items} at most, and only with store: true)",
                           param, "previous_response_not_found" if param == "previous_response_id" else "not_found")
        return found

    async def _chat_jobs(req: ChatCompletionRequest) -> list[Job]:
        """The scheduler requests of a chat request: its constraints, prompt, limit and stops."""
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        constrained = (req.tools or req.response_format is not None or req.structured_outputs is not None) \
            and not (req.response_format is not None and req.response_format.type == "text" and not req.tools)
        constraints = [None] * req.n
        if constrained and served.chat is not None:  # schemas first: their errors name the parameter at fault
            def build() -> list[Any]:  # compiles (bounded by a deadline in a child process) run off the event loop
                return [structured.request_constraint(req, served.chat, served.grammars) for _ in range(req.n)]

            constraints = await asyncio.to_thread(build)
        prompt = served.chat_prompt([_message(m) for m in req.messages], tools)
        limit = served.max_tokens(req.limit(), len(prompt), "messages", req.n)
        token_text = dict(served.tool_text)
        if served.chat is not None and served.chat.has_tools:
            token_text.update({served.chat.ids[t]: "" for t in ("<|call_start|>", "<|call_end|>")})
        return [_job(req, prompt, limit, served.chat_stops(), served.chat_tool, token_text, k, c)
                for k, c in enumerate(constraints)]

    def _job(req: Any, prompt: list[int], limit: int, stop_ids: list[int],
             tool: Callable[[], Callable[[int], list[int] | None]] | None, token_text: dict[int, str] | None,
             k: int, constraint: Any = None) -> Job:
        try:
            return Job(prompt, limit, _noop, temperature=req.temperature,
                       top_p=None if req.top_p >= 1 else req.top_p, seed=req.choice_seed(k), stop_ids=stop_ids,
                       stop=req.stops(), tool=tool() if tool is not None else None, token_text=token_text or {},
                       constraint=constraint, capture_regions=constraint is not None and bool(getattr(req, "tools", None)),
                       logprobs=req.n_logprobs(), speculative=req.speculative)
        except ValueError as e:  # a value the schema let through but the engine refuses
            raise APIError(400, str(e)) from None

    def _submit(jobs: list[Job]) -> tuple["asyncio.Queue[tuple[int, Update] | None]", Timing]:
        """Hand ``jobs`` to the scheduler: the queue their updates arrive on (``(k, update)``; None: the client
        went away) and their timing; APIError 400/429/503 if the scheduler refuses them."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[tuple[int, Update] | None] = asyncio.Queue()
        for k, job in enumerate(jobs):
            job.emit = (lambda k: lambda u: loop.call_soon_threadsafe(updates.put_nowait, (k, u)))(k)
        try:
            sched.submit_many(jobs)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except QueueFull as e:
            raise APIError(429, f"the server is busy: {e}", code="rate_limit_exceeded", type="rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except RuntimeError as e:  # stopping
            raise APIError(503, f"the server is shutting down ({e})", type="server_error") from None
        return updates, Timing(metrics, len(jobs))

    async def _collect(request: Request, jobs: list[Job], updates: asyncio.Queue[Any], timing: Timing,
                       take: Callable[[int, Update], Any]) -> bool:
        """Feed each update of ``jobs`` to ``take(k, update)`` until all have ended; False if the client went
        away first (its jobs cancelled). Jobs still running when ``take`` raises are cancelled."""
        running = set(range(len(jobs)))
        watcher = asyncio.create_task(_watch(request, jobs, updates))
        try:
            while running:
                got = await updates.get()
                if got is None:  # cancelled by the watcher
                    return False
                k, u = got
                timing.update(k, u)
                take(k, u)
                if u.finish_reason is not None:
                    running.discard(k)
        finally:
            watcher.cancel()
            for k in running:
                sched.cancel(jobs[k])
        return True

    async def _answer(request: Request, jobs: list[Job], req: Any, kind: str) -> Response:
        updates, timing = _submit(jobs)
        rid = api.new_id("chatcmpl" if kind == "chat" else "cmpl")
        endpoint = _endpoint(request)
        if req.stream:
            return StreamingResponse(_stream(jobs, updates, rid, kind, req, timing, endpoint),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        choices = [Choice(job) for job in jobs]
        if not await _collect(request, jobs, updates, timing, lambda k, u: choices[k].add(u)):
            return Response(status_code=499)
        for c in choices:
            if c.last.finish_reason in ("error", "cancelled"):
                raise APIError(500, c.last.error or "the request was cancelled: the server is stopping",
                               type="server_error")
        prompt_tokens = choices[0].last.prompt_tokens
        use = api.usage(prompt_tokens, sum(c.last.completion_tokens for c in choices), choices[0].last.cached_tokens)
        metrics.request(endpoint, 200)
        metrics.tokens(prompt_tokens, use["completion_tokens"])
        tb = _bytes
        if kind == "chat":
            out = [{"message": api.chat_message(c.text(), c.calls), "finish_reason": c.finish(),
                     "logprobs": api.chat_logprobs(c.lps, tb) if req.logprobs else None} for c in choices]
            return JSONResponse(api.chat_completion(rid, served.model_id, out, use))
        body = api.completion(rid, served.model_id, "", None, use)
        body["choices"] = [{"index": k, "text": c.text(), "finish_reason": c.finish(),
                            "logprobs": api.completion_logprobs(c.lps, tb) if req.logprobs is not None else None}
                           for k, c in enumerate(choices)]
        return JSONResponse(body)

    async def _watch(request: Request, jobs: list[Job], updates: asyncio.Queue[Any]) -> None:
        """Cancel ``jobs`` as soon as their client disconnects (the body is read: the next message the server
        gives is the disconnect), however busy their rows are; then wake the request's reader."""
        try:
            while (await request.receive())["type"] != "http.disconnect":
                await asyncio.sleep(0.05)  # (a server that answers anything else: look again, without spinning)
        except Exception:  # noqa: BLE001  (the connection broke while waiting: gone as well)
            pass
        for job in jobs:
            sched.cancel(job)
        updates.put_nowait(None)

    async def _stream(jobs: list[Job], updates: asyncio.Queue[Any], rid: str, kind: str, req: Any,
                      timing: Timing, endpoint: str) -> AsyncIterator[bytes]:
        model_id, failed = served.model_id, False
        open_rows = set(range(len(jobs)))
        calls = [0] * len(jobs)  # tool calls sent per choice
        total = [0] * len(jobs)
        tb = _bytes
        offsets = [0] * len(jobs)

        def chunk(k: int, text: str, u: Update | None = None, finish: str | None = None,
                  use: dict[str, int] | None = None, choices: bool = True) -> bytes:
            lps = u.logprobs if u is not None else ()
            if kind == "chat":
                lp = api.chat_logprobs(lps, tb) if req.logprobs and lps else None
                return api.sse(api.chat_chunk(rid, model_id, {"content": text} if text else {}, finish, use, choices,
                                              k, lp))
            lp = api.completion_logprobs(lps, tb, offsets[k]) if req.logprobs is not None and lps else None
            offsets[k] += len(text)
            return api.sse(api.completion(rid, model_id, text, finish, use, choices, k, lp))

        try:
            if kind == "chat":
                for k in range(len(jobs)):
                    yield api.sse(api.chat_chunk(rid, model_id, {"role": "assistant", "content": ""}, index=k))
            while open_rows:
                if not updates.empty():  # a burst: let the loop notice a client that left before writing again
                    await asyncio.sleep(0)  # (asyncio logs a warning for every write to a lost connection)
                got = await updates.get()
                assert got is not None  # (only the non-streaming watcher sends None)
                k, u = got
                timing.update(k, u)
                if u.finish_reason in ("error", "cancelled"):
                    failed = True
                    msg = u.error or "the request was cancelled: the server is stopping"
                    metrics.request(endpoint, 500)
                    yield api.sse(api.error_body(msg, "server_error"))
                    break
                if u.text or (u.logprobs and u.finish_reason is None):
                    yield chunk(k, u.text, u)
                for text in u.regions:
                    call = structured.parse_call(text)
                    delta = {"tool_calls": [{"index": calls[k], **call}]}
                    calls[k] += 1
                    yield api.sse(api.chat_chunk(rid, model_id, delta, index=k))
                if u.finish_reason is None:
                    continue
                open_rows.discard(k)
                total[k] = u.completion_tokens
                finish = "tool_calls" if calls[k] and u.finish_reason == "stop" else u.finish_reason
                cut = structured.cut_call(jobs[k]) if finish == "length" else ""
                if cut:  # a call cut by max_tokens: what was generated, as text
                    yield chunk(k, cut)
                yield chunk(k, "", None, finish,
                            api.usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens) if len(jobs) == 1 else None)
                if not open_rows:
                    use = api.usage(u.prompt_tokens, sum(total), u.cached_tokens)
                    metrics.request(endpoint, 200)
                    metrics.tokens(u.prompt_tokens, sum(total))
                    if req.include_usage():
                        yield chunk(k, "", None, None, use, choices=False)
            yield api.SSE_DONE
        finally:
            if open_rows or failed:  # the client went away, a choice failed, or the server is stopping: free rows
                for job in jobs:
                    sched.cancel(job)

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


def _endpoint(request: Request) -> str:
    """The matched route's path template (``/v1/models/{name}``), or ``other``: a metric label is never a path
    a client wrote (each would be a new series)."""
    return getattr(request.scope.get("route"), "path", None) or "other"


def _noop(update: Update) -> None:
    """Placeholder ``emit`` until the request is bound to its event loop."""


def _message(m: Any) -> dict[str, Any]:
    """An API message as the chat format's message (text content; tool calls and ids kept)."""
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _base64(vector: list[float]) -> str:
    """An embedding as OpenAI's ``encoding_format: "base64"`` sends it: little-endian float32 bytes."""
    import base64
    import struct

    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "lmforge"}
