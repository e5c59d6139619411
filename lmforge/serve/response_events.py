"""The Responses API's answer: the ``response`` object and its streamed events, built from the scheduler's updates.

One :class:`ResponseBuilder` turns a request's updates into output items, a plain answer and a stream alike (a
plain answer is the stream's last ``response`` object): text opens a ``message`` item (``output_text`` part),
each captured function call is a ``function_call`` item (``call_id``, ``name``, ``arguments``), and the end sets
the ``status`` (``completed``; ``incomplete`` with ``incomplete_details.reason: max_output_tokens``; ``failed``
with ``error``) and the ``usage``. The stream's events, each numbered by ``sequence_number``, are those the
``openai`` client's stream helper accumulates::

    response.created, response.in_progress
    response.output_item.added (message), response.content_part.added, response.output_text.delta ...,
    response.output_text.done, response.content_part.done, response.output_item.done
    response.output_item.added (function_call), response.function_call_arguments.delta,
    response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete | response.failed
"""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator, Callable

from lmforge.generate.scheduler import Job, Update
from lmforge.serve import api, structured
from lmforge.serve.errors import APIError
from lmforge.serve.responses import ResponseRequest, new_id
from lmforge.serve.service import Updates

__all__ = ["ResponseBuilder", "stream"]


def _event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, **fields}


class ResponseBuilder:
    """The response to ``req`` (id ``rid``, served as ``model``), item by item as the updates of its ``job`` come.

    ``keep(builder)`` stores a response that completed or was cut by ``max_output_tokens`` (with ``req.store``) and
    says whether it did (not over its tenant's budget); it runs before the last event is built, so the response's
    ``store`` is true only for a response that was stored (the first events echo the request's ``store``)."""

    def __init__(self, rid: str, model: str, req: ResponseRequest, job: Job, token_bytes: Callable[[int], bytes],
                 keep: Callable[["ResponseBuilder"], bool]) -> None:
        self.rid, self.model, self.req, self.job, self.token_bytes, self.keep = rid, model, req, job, token_bytes, keep
        self.stored = req.store
        self.created = int(time.time())
        self.completed_at: int | None = None
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.sequence = 0
        self._message: dict[str, Any] | None = None  # the message item open for text, if any

    # ---------------------------------------------------------------------------------------------
    def resource(self) -> dict[str, Any]:
        """The ``response`` object as it stands."""
        req = self.req
        fmt = req.text.format if req.text is not None else None
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": self.status,
            "completed_at": self.completed_at, "error": self.error,
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": self.output,
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None and
                     fmt.type == "json_schema" else {"type": fmt.type if fmt is not None else "text"}},
            "tool_choice": req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump")
            else req.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "truncation": "disabled", "store": self.stored, "usage": self.usage, "user": req.user,
            "metadata": req.metadata or {},
        }

    def reply(self) -> dict[str, Any]:
        """The reply as a chat message: every ``output_text`` part's text, the function calls as ``tool_calls``."""
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.output if i["type"] == "function_call"]
        text = "".join(c["text"] for item in self.output if item["type"] == "message" for c in item["content"])
        return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}

    def _numbered(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for e in events:
            e["sequence_number"] = self.sequence
            self.sequence += 1
        return events

    # ---------------------------------------------------------------------------------------------
    def start(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        return self._numbered([_event("response.created", response=self.resource()),
                               _event("response.in_progress", response=self.resource())])

    def add(self, u: Update) -> list[dict[str, Any]]:
        """The events of update ``u`` (its reply's end as :func:`~lmforge.serve.structured.reply_end` gives it)."""
        text = u.text + structured.reply_end(self.job, u)
        lps = api.chat_logprobs(u.logprobs, self.token_bytes)["content"] if self.req.logprobs() else []
        events = self._text(text, lps) if text or lps else []
        for region in u.regions:
            events += self._call(structured.parse_call(region))
        if u.finish_reason in ("error", "cancelled"):
            return self._numbered(events) + self.fail(str(u.error))
        if u.finish_reason is not None:
            events += self._end(u)
        return self._numbered(events)

    def _text(self, text: str, lps: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events, m = [], self._message
        if m is None:  # (an open message is the last item: a call closes it)
            m = self._message = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                                 "content": []}
            self.output.append(m)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += [_event("response.output_item.added", output_index=len(self.output) - 1, item=_copy(m)),
                       _event("response.content_part.added", item_id=m["id"], output_index=len(self.output) - 1,
                              content_index=0, part=_copy(part))]
            m["content"].append(part)
        m["content"][0]["text"] += text
        m["content"][0]["logprobs"] += lps
        return events + [_event("response.output_text.delta", item_id=m["id"], output_index=len(self.output) - 1,
                                content_index=0, delta=text, logprobs=[_brief(x) for x in lps])]

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        m, self._message = self._message, None
        if m is None:
            return []
        index = self.output.index(m)
        part = m["content"][0]
        m["status"] = status
        return [_event("response.output_text.done", item_id=m["id"], output_index=index, content_index=0,
                       text=part["text"], logprobs=[_brief(x) for x in part["logprobs"]]),
                _event("response.content_part.done", item_id=m["id"], output_index=index, content_index=0,
                       part=_copy(part)),
                _event("response.output_item.done", output_index=index, item=_copy(m))]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close_message("completed")
        item = {"id": new_id("fc"), "type": "function_call", "status": "completed", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"]}
        self.output.append(item)
        index = len(self.output) - 1
        return events + [
            _event("response.output_item.added", output_index=index,
                   item={**item, "status": "in_progress", "arguments": ""}),
            _event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                   delta=item["arguments"]),
            _event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                   name=item["name"], arguments=item["arguments"]),
            _event("response.output_item.done", output_index=index, item=_copy(item))]

    def _end(self, u: Update) -> list[dict[str, Any]]:
        self.status = "incomplete" if u.finish_reason == "length" else "completed"
        self.completed_at = int(time.time()) if self.status == "completed" else None
        self.usage = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                      "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": u.prompt_tokens + u.completion_tokens}
        events = self._close_message(self.status)
        self.stored = self.req.store and self.keep(self)
        return events + [_event(f"response.{self.status}", response=self.resource())]

    def fail(self, message: str, code: str = "server_error") -> list[dict[str, Any]]:
        """``response.failed`` (status ``failed``, ``error`` set): the reply stopped on an error."""
        self._close_message("incomplete")
        self.status, self.error, self.stored = "failed", {"code": code, "message": message}, False
        return self._numbered([_event("response.failed", response=self.resource())])


def _brief(lp: dict[str, Any]) -> dict[str, Any]:
    """A token's log-probability as the text events carry it (no bytes)."""
    return {"token": lp["token"], "logprob": lp["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in lp["top_logprobs"]]}


def _copy(obj: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item as sent now (the builder goes on changing its own)."""
    return json.loads(json.dumps(obj))


async def stream(builder: ResponseBuilder, updates: Updates,
                 done: Callable[[ResponseBuilder], None]) -> AsyncIterator[bytes]:
    """The server-sent events of one response (an APIError of its reply's end sent as ``response.failed``);
    ``done(builder)`` runs once the response ended (any status); the job is cancelled if the stream stops first."""
    try:
        for e in builder.start():
            yield api.sse(e, e["type"])
        while updates.running:
            got = await updates.next()
            assert got is not None  # (only the non-streaming watcher sends None)
            try:
                events = builder.add(got[1])
            except APIError as e:  # (the request's grammar failed while decoding, ending it: its error, as the event)
                events = builder.fail(e.message, e.code or "invalid_request_error")
            for event in events:
                yield api.sse(event, event["type"])
        done(builder)
    finally:
        updates.close()
