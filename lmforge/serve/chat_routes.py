"""The generation routes of the Chat Completions dialect: ``POST /v1/chat/completions`` (parsed into the one internal
chat request, run by :meth:`~lmforge.serve.service.Service.chat_jobs`) and ``POST /v1/completions`` (a raw prompt).
Each answers as one JSON object (its choices built by :class:`Choice`) or, with ``stream``, as server-sent events
(``data: {chunk}`` lines, then ``data: [DONE]``).
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lmforge.generate.scheduler import Job, Update
from lmforge.serve import api, structured
from lmforge.serve.api import ChatCompletionRequest, CompletionRequest
from lmforge.serve.errors import APIError, error_body
from lmforge.serve.request import Sampling
from lmforge.serve.service import Service, Updates, endpoint

__all__ = ["Choice", "add_chat_routes", "completion_jobs"]


def completion_jobs(svc: Service, req: CompletionRequest, tenant: str) -> list[Job]:
    """The scheduler jobs of a completions request of ``tenant``: its prompt continued, ``n`` choices."""
    served = svc.served
    prompt = served.text_prompt(req.text())
    limit = served.max_tokens(req.limit(), len(prompt), "prompt", req.n)
    stops = [] if served.tokenizer.eot_id is None else [served.tokenizer.eot_id]
    s = Sampling(**req.sampling())
    return [svc.job(s, tenant, prompt, limit, stops, None, None, k) for k in range(req.n)]


def add_chat_routes(app: FastAPI, svc: Service) -> None:
    """Add ``/v1/chat/completions`` and ``/v1/completions`` to ``app``."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        tenant, req = await svc.read(request, ChatCompletionRequest)
        return await _answer(svc, request, await svc.chat_jobs(req.chat_request(), tenant), req, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        tenant, req = await svc.read(request, CompletionRequest)
        return await _answer(svc, request, completion_jobs(svc, req, tenant), req, "text")


class Choice:
    """One choice of a plain (non-streamed) answer to ``job``, as its updates arrive."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.text = ""
        self.lps: list[Any] = []
        self.calls: list[dict[str, Any]] = []
        self.last: Update | None = None

    def add(self, u: Update) -> None:
        """Take ``u``; APIError 400 if the request's grammar failed (:func:`~lmforge.serve.structured.reply_end`)."""
        self.text += u.text + structured.reply_end(self.job, u)
        self.lps.extend(u.logprobs)
        self.calls.extend(structured.parse_call(t) for t in u.regions)
        if u.finish_reason is not None:
            self.last = u

    def finish(self) -> str:
        assert self.last is not None
        return "tool_calls" if self.calls and self.last.finish_reason == "stop" else str(self.last.finish_reason)


async def _answer(svc: Service, request: Request, jobs: list[Job], req: Any, kind: str) -> Response:
    """The answer to ``req`` (``kind`` ``chat`` or ``text``) from ``jobs``: one JSON object, or a stream."""
    updates = svc.submit(jobs)
    rid, model_id = api.new_id("chatcmpl" if kind == "chat" else "cmpl"), svc.served.model_id
    if req.stream:
        return StreamingResponse(_stream(svc, updates, rid, kind, req, endpoint(request)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    choices = [Choice(job) for job in jobs]
    if not await svc.collect(request, updates, lambda k, u: choices[k].add(u)):
        return Response(status_code=499)
    for c in choices:
        if c.last.finish_reason in ("error", "cancelled"):
            raise APIError(500, str(c.last.error), type="server_error")
    prompt_tokens = choices[0].last.prompt_tokens
    use = api.usage(prompt_tokens, sum(c.last.completion_tokens for c in choices), choices[0].last.cached_tokens)
    svc.ok(request)
    svc.metrics.tokens(prompt_tokens, use["completion_tokens"])
    tb, logprobs = svc.token_bytes, req.n_logprobs() is not None
    if kind == "chat":
        out = [{"message": api.chat_message(c.text, c.calls), "finish_reason": c.finish(),
                "logprobs": api.chat_logprobs(c.lps, tb) if logprobs else None} for c in choices]
        return JSONResponse(api.answer("chat.completion", rid, model_id, out, use))
    out = [{"text": c.text, "finish_reason": c.finish(),
            "logprobs": api.completion_logprobs(c.lps, tb) if logprobs else None} for c in choices]
    return JSONResponse(api.answer("text_completion", rid, model_id, out, use))


async def _stream(svc: Service, updates: Updates, rid: str, kind: str, req: Any, route: str) -> AsyncIterator[bytes]:
    """The server-sent events of ``updates``; jobs still running when the stream stops are cancelled."""
    metrics, model_id, jobs = svc.metrics, svc.served.model_id, updates.jobs
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    calls = [0] * len(jobs)  # tool calls sent per choice
    offsets = [0] * len(jobs)  # characters sent per choice (a completion's text_offset)
    total = 0
    tb, logprobs = svc.token_bytes, req.n_logprobs() is not None

    def chunk(k: int, content: dict[str, Any], lp: Any = None, finish: str | None = None,
              use: dict[str, int] | None = None) -> bytes:
        return api.sse(api.answer(obj, rid, model_id, [{**content, "logprobs": lp, "finish_reason": finish}], use, k))

    def piece(k: int, text: str, lps: Sequence[Any] = ()) -> bytes:
        if kind == "chat":
            return chunk(k, {"delta": {"content": text} if text else {}},
                         api.chat_logprobs(lps, tb) if logprobs and lps else None)
        lp = api.completion_logprobs(lps, tb, offsets[k]) if logprobs and lps else None
        offsets[k] += len(text)
        return chunk(k, {"text": text}, lp)

    try:
        if kind == "chat":
            for k in range(len(jobs)):
                yield chunk(k, {"delta": {"role": "assistant", "content": ""}})
        while updates.running:
            got = await updates.next()
            assert got is not None  # (only the non-streaming watcher sends None)
            k, u = got
            if u.finish_reason in ("error", "cancelled"):  # (the others are cancelled below)
                metrics.request(route, 500)
                yield api.sse(error_body(str(u.error), "server_error"))
                break
            if u.text or (u.logprobs and u.finish_reason is None):
                yield piece(k, u.text, u.logprobs)
            for region in u.regions:
                yield chunk(k, {"delta": {"tool_calls": [{"index": calls[k], **structured.parse_call(region)}]}})
                calls[k] += 1
            if u.finish_reason is None:
                continue
            total += u.completion_tokens
            finish = "tool_calls" if calls[k] and u.finish_reason == "stop" else u.finish_reason
            cut = structured.reply_end(jobs[k], u)
            if cut:  # a call cut by max_tokens: what was generated, as text
                yield piece(k, cut)
            yield chunk(k, {"delta": {}} if kind == "chat" else {"text": ""}, None, finish,
                        api.usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens) if len(jobs) == 1 else None)
            if not updates.running:
                metrics.request(route, 200)
                metrics.tokens(u.prompt_tokens, total)
                if (req.stream_options or {}).get("include_usage"):
                    use = api.usage(u.prompt_tokens, total, u.cached_tokens)
                    yield api.sse(api.answer(obj, rid, model_id, [], use))
        yield api.SSE_DONE
    finally:  # the client went away, a choice failed, or the server is stopping: free rows
        updates.close()

