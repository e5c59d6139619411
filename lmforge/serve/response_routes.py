"""The Responses API's routes: ``POST /v1/responses`` (parsed into the one internal chat request,
:mod:`~lmforge.serve.responses`; events and objects by :mod:`~lmforge.serve.response_events`), ``GET`` and
``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``.

A stored response (:mod:`~lmforge.serve.response_store`; which are stored: ``ResponseBuilder``'s ``keep``) is found
only by the tenant (API key) that created it, on every route and as ``previous_response_id``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lmforge.serve import response_events, responses
from lmforge.serve.errors import APIError
from lmforge.serve.response_events import ResponseBuilder
from lmforge.serve.service import Service, endpoint

__all__ = ["add_response_routes"]


def add_response_routes(app: FastAPI, svc: Service) -> None:
    """Add the Responses API's routes to ``app``."""
    store, metrics = svc.store, svc.metrics

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        tenant, req = await svc.read(request, responses.ResponseRequest)
        history = svc.stored(tenant, req.previous_response_id, "previous_response_id").history \
            if req.previous_response_id else []
        messages, where = responses.conversation(req, history)
        jobs = await svc.chat_jobs(responses.chat_request(req, messages, where), tenant)

        def keep(b: ResponseBuilder) -> bool:
            return store.put(tenant, b.rid, b.resource(), [*messages, b.reply()], responses.input_items(req))

        builder = ResponseBuilder(responses.new_id("resp"), svc.served.model_id, req, jobs[0], svc.token_bytes, keep)
        updates, route = svc.submit(jobs), endpoint(request)

        def done(b: ResponseBuilder) -> None:
            failed = b.error["code"] if b.error is not None else None
            metrics.request(route, 200 if failed is None else 500 if failed == "server_error" else 400)
            if b.usage is not None:
                metrics.tokens(b.usage["input_tokens"], b.usage["output_tokens"])

        if req.stream:
            events = response_events.stream(builder, updates, done)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        if not await svc.collect(request, updates, lambda k, u: builder.add(u)):
            return Response(status_code=499)
        if builder.error is not None:  # (set by fail() alone, with status failed)
            raise APIError(500, builder.error["message"], type="server_error")
        done(builder)
        return JSONResponse(builder.resource())

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> Response:
        tenant = svc.authorize(request)
        found = svc.stored(tenant, response_id, "response_id")
        svc.ok(request)
        return Response(found.resource_json, media_type="application/json")

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, request: Request) -> dict[str, Any]:
        tenant = svc.authorize(request)
        page = responses.items_page(svc.stored(tenant, response_id, "response_id").inputs, request.query_params)
        svc.ok(request)
        return page

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        tenant = svc.authorize(request)
        if not store.delete(tenant, response_id):
            svc.stored(tenant, response_id, "response_id")  # (raises its 404)
        svc.ok(request)
        return {"id": response_id, "object": "response.deleted", "deleted": True}
