"""What every API route of one app shares (:class:`Service`): a request's tenant (or 401), its body read within
bounds and parsed, its scheduler jobs (each under its prefix-cache salt, :func:`cache_salt`), submitted, and their
updates read until the end or until the client goes away (the jobs then cancelled), timed into the metrics.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable, Sequence

from fastapi import Request
from pydantic import BaseModel

from lmforge.generate.scheduler import Job, QueueFull, Update
from lmforge.generate.constraints import ConstraintError
from lmforge.serve import structured
from lmforge.serve.access import PUBLIC, Keys
from lmforge.serve.api import parse
from lmforge.serve.errors import APIError, shown
from lmforge.serve.metrics import Metrics
from lmforge.serve.request import ChatRequest, Sampling
from lmforge.serve.response_store import ResponseStore, Stored

__all__ = ["RETRY_AFTER_S", "Service", "Updates", "cache_salt", "endpoint"]

RETRY_AFTER_S = 1


def cache_salt(tenant: str, salt: str | None) -> str | None:
    """The prefix-cache salt of a request of ``tenant`` that sent ``salt`` (its ``cache_salt``): None for the
    public tenant (a server without keys) without a salt, so such requests share blocks; else both as one JSON
    array, so two tenants, or two salts of one tenant, never share a block (no pair spells another's salt)."""
    if tenant == PUBLIC and salt is None:
        return None
    return json.dumps([tenant, salt], ensure_ascii=False)


def endpoint(request: Request) -> str:
    """The matched route's path template (``/v1/models/{name}``), or ``other``: a metric label is never a path
    a client wrote (each would be a new series)."""
    return getattr(request.scope.get("route"), "path", None) or "other"


def _noop(update: Update) -> None:
    """Placeholder ``emit`` until the request is bound to its event loop."""


class Updates:
    """The updates of one request's ``jobs`` as they reach the event loop, ``(k, update)`` for job ``k``, each timed
    into ``metrics`` (time to first token and inter-token latency); :meth:`close` cancels the jobs still running."""

    def __init__(self, sched: Any, metrics: Metrics, jobs: list[Job]) -> None:
        self.sched, self.metrics, self.jobs, self.t0 = sched, metrics, jobs, time.perf_counter()
        self.queue: asyncio.Queue[tuple[int, Update] | None] = asyncio.Queue()  # None: the client went away
        self.running = set(range(len(jobs)))
        self.seen = [0] * len(jobs)
        self.at = [self.t0] * len(jobs)

    async def next(self) -> tuple[int, Update] | None:
        """The next update, timed; after a burst, a turn of the loop first, so that a stream notices a client that
        left before it writes again (asyncio logs a warning for every write to a lost connection)."""
        if not self.queue.empty():
            await asyncio.sleep(0)
        got = await self.queue.get()
        if got is not None:
            k, u = got
            now, new = time.perf_counter(), u.completion_tokens - self.seen[k]
            if new > 0:
                if self.seen[k] == 0:
                    self.metrics.first_token(now - self.t0)
                    new -= 1
                self.metrics.between_tokens(now - self.at[k], new)
                self.seen[k], self.at[k] = u.completion_tokens, now
            if u.finish_reason is not None:
                self.running.discard(k)
        return got

    def close(self) -> None:
        """Cancel the jobs still running: their reader stopped first."""
        for k in self.running:
            self.sched.cancel(self.jobs[k])


class Service:
    """The shared part of one app over ``served`` (a :class:`~lmforge.serve.server.ServedModel`): ``keys`` (None:
    no key, one tenant), ``metrics``, the Responses ``store``, and the body bounds (``max_body`` bytes within
    ``body_timeout`` seconds)."""

    def __init__(self, served: Any, keys: Keys | None, metrics: Metrics, store: ResponseStore, max_body: int,
                 body_timeout: float) -> None:
        self.served, self.sched, self.keys, self.metrics, self.store = served, served.scheduler, keys, metrics, store
        self.max_body, self.body_timeout = max_body, body_timeout

    def authorize(self, request: Request) -> str:
        """The request's tenant: :data:`~lmforge.serve.access.PUBLIC` without keys, else the id of the key its
        ``Authorization`` header sends; APIError 401 for a missing or wrong key."""
        if self.keys is None:
            return PUBLIC
        tenant = self.keys.tenant(request.headers.get("authorization", ""))
        if tenant is None:
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' with a key "
                                "the server was started with", code="invalid_api_key")
        return tenant

    def ok(self, request: Request) -> None:
        """Count a request answered 200 under its route."""
        self.metrics.request(endpoint(request), 200)

    async def body(self, request: Request) -> bytes:
        """The request's JSON body: 415 unless sent as ``Content-Type: application/json`` (which a cross-site page
        cannot send without the CORS preflight this server never grants), 413 over ``max_body`` bytes, 408 if it
        takes longer than ``body_timeout`` seconds to arrive (the connection then closes)."""
        kind = request.headers.get("content-type", "")
        if kind.partition(";")[0].strip().lower() != "application/json":
            raise APIError(415, f"the request body must be JSON sent with 'Content-Type: application/json' (this "
                                f"one came with {shown(kind) if kind else 'none'})", code="unsupported_media_type")
        declared, limit = request.headers.get("content-length"), self.max_body
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body has {declared} bytes, over this server's limit of {limit}",
                           code="request_too_large")
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout):  # a client trickling its body does not hold a connection
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise APIError(413, f"the request body is over this server's limit of {limit} bytes",
                                       code="request_too_large")
                    chunks.append(chunk)
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.body_timeout:g} s ({size} bytes came); "
                                "send it at once", code="request_timeout", headers={"Connection": "close"}) from None
        return b"".join(chunks)

    async def read(self, request: Request, cls: type[BaseModel]) -> tuple[str, Any]:
        """The request's tenant and its body parsed as ``cls``, the ``model`` it names checked if it names one."""
        tenant = self.authorize(request)
        req = parse(cls, await self.body(request))
        if req.model is not None:
            self.check_model(req.model)
        return tenant, req

    def check_model(self, name: str) -> None:
        if name != self.served.model_id:
            raise APIError(404, f"model {shown(name)} does not exist; this server serves {self.served.model_id!r} "
                                "(see GET /v1/models)", "model", "model_not_found")

    def token_bytes(self, t: int) -> bytes:
        return self.served.tokenizer.decode_bytes([t])

    def stored(self, tenant: str, rid: str, param: str) -> Stored:
        """``tenant``'s stored response ``rid``; APIError 404 if there is none (another tenant's is not found either:
        the same answer, so an id tells nothing of what others store)."""
        found = self.store.get(tenant, rid)
        if found is None:
            s = self.store
            raise APIError(404, f"no stored response has id {shown(rid)} (responses are kept in memory for {s.ttl:g} "
                                f"s, {s.max_items} per API key at most, and only with store: true)", param,
                           "previous_response_not_found" if param == "previous_response_id" else "not_found")
        return found

    # ---------------------------------------------------------------------------------------------
    async def chat_jobs(self, req: ChatRequest, tenant: str) -> list[Job]:
        """The scheduler jobs of a chat request of ``tenant``: its constraints, prompt, limit and stops (errors in
        its dialect's names)."""
        served, names = self.served, req.dialect
        if served.chat is None:
            raise APIError(400, served.no_chat, names.param("messages"), "chat_not_supported")
        constraints = [None] * req.n
        if req.tools or req.format is not None:  # schemas first: their errors name the parameter at fault
            try:
                grammars = served.grammars
            except ConstraintError as e:  # llguidance is not installed
                raise APIError(400, str(e), req.format.field if req.format else "tools",
                               "constraints_not_supported") from None

            def build() -> list[Any]:  # compiles (bounded by a deadline in a child process) run off the event loop
                return [structured.request_constraint(req, served.chat, grammars) for _ in range(req.n)]

            constraints = await asyncio.to_thread(build)
        prompt = served.chat_prompt(req.messages, req.tool_dicts(), req.message_error)
        limit = served.max_tokens(req.max_tokens, len(prompt), names.param("messages"), req.n,
                                  names.param("max_tokens"))
        return [self.job(req, tenant, prompt, limit, served.chat.stop_ids, served.chat_tool, served.tool_text, k, c,
                         capture=c is not None and bool(req.tools)) for k, c in enumerate(constraints)]

    def job(self, s: Sampling, tenant: str, prompt: list[int], limit: int, stop_ids: Sequence[int],
            tool: Callable[[], Callable[[int], list[int] | None]] | None, token_text: dict[int, str] | None,
            k: int, constraint: Any = None, capture: bool = False) -> Job:
        """Choice ``k``'s scheduler job for a request of ``tenant`` sampling as ``s``; APIError 400 for a value
        the engine refuses."""
        try:
            return Job(prompt, limit, _noop, temperature=s.temperature, top_p=None if s.top_p >= 1 else s.top_p,
                       seed=s.seed_of(k), stop_ids=stop_ids, stop=s.stop, tool=tool() if tool is not None else None,
                       token_text=token_text or {}, constraint=constraint, capture_regions=capture,
                       logprobs=s.logprobs, speculative=s.speculative, cache_salt=cache_salt(tenant, s.cache_salt))
        except ValueError as e:  # a value the schema let through but the engine refuses
            raise APIError(400, str(e)) from None

    def submit(self, jobs: list[Job]) -> Updates:
        """Hand ``jobs`` to the scheduler; their updates arrive on the :class:`Updates` returned. APIError
        400/429/503 if the scheduler refuses them."""
        loop, updates = asyncio.get_running_loop(), Updates(self.sched, self.metrics, jobs)
        for k, job in enumerate(jobs):
            job.emit = (lambda k: lambda u: loop.call_soon_threadsafe(updates.queue.put_nowait, (k, u)))(k)
        try:
            self.sched.submit_many(jobs)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except QueueFull as e:
            raise APIError(429, f"the server is busy: {e}", code="rate_limit_exceeded", type="rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except RuntimeError as e:  # stopping
            raise APIError(503, f"the server is shutting down ({e})", type="server_error") from None
        return updates

    async def collect(self, request: Request, updates: Updates, take: Callable[[int, Update], Any]) -> bool:
        """Feed each update to ``take(k, update)`` until every job has ended; False if the client went away first
        (its jobs cancelled). Jobs still running when ``take`` raises are cancelled."""
        watcher = asyncio.create_task(_watch(request, updates))
        try:
            while updates.running:
                got = await updates.next()
                if got is None:  # cancelled by the watcher
                    return False
                take(*got)
        finally:
            watcher.cancel()
            updates.close()
        return True


async def _watch(request: Request, updates: Updates) -> None:
    """Cancel a plain request's jobs as soon as its client disconnects (the body is read: the next message the
    server gives is the disconnect), however busy their rows are; then wake the request's reader."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            await asyncio.sleep(0.05)  # (a server that answers anything else: look again, without spinning)
    except Exception:  # noqa: BLE001  (the connection broke while waiting: gone as well)
        pass
    updates.close()
    updates.queue.put_nowait(None)
