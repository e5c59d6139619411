"""``POST /v1/responses``, the OpenAI Responses API: its request schema, read as the one internal chat request
(:func:`chat_request`; its errors name the client's fields through :data:`RESPONSES` and :data:`Origins`), so a
greedy or seeded reply is the one ``/v1/chat/completions`` gives for the same conversation: ``instructions`` (never
carried to the next response), the stored conversation of ``previous_response_id``, then ``input``
(:func:`conversation`, :func:`_chat_messages`). Bookkeeping fields are accepted (``metadata`` and ``user`` echoed);
those that would change the answer and are not implemented are refused (:meth:`ResponseRequest.refuse_unsupported`).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, StringConstraints, Tag, field_validator

from lmforge.generate.sampling import SEED_MAX, SEED_MIN
from lmforge.generate.scheduler import MAX_LOGPROBS
from lmforge.serve.api import FunctionDef, JsonSchemaFormat, NamedFunction, Strict, joined
from lmforge.serve.errors import APIError, refuse_unsupported, shown, unsupported
from lmforge.serve.limits import SALT_MAX, TOKENS_MAX
from lmforge.serve.request import ChatRequest, Dialect, Format

__all__ = ["RESPONSES", "ResponseRequest", "UNSUPPORTED", "conversation", "input_items", "items_page", "new_id"]

RESPONSES = Dialect({"messages": "input", "max_tokens": "max_output_tokens", "tool.parameters": "tools.{k}.parameters"})
"""The Responses API's names of the internal request's fields (the others are its own)."""

LOGPROBS = "message.output_text.logprobs"
"""The one ``include`` value served: each output token's log-probability (and ``top_logprobs`` alternatives)."""
ITEM_TYPES = ("message", "function_call", "function_call_output")

UNSUPPORTED: dict[str, str] = {
    "reasoning": "reasoning is not supported by lmforge serve (its models do not reason in hidden tokens); remove it",
    "background": "background responses are not supported by lmforge serve; send the request and wait (or stream)",
    "conversation": "conversation objects are not supported by lmforge serve; continue a conversation with "
                    "previous_response_id",
    "prompt": "prompt templates are not supported by lmforge serve; send the text as input",
    "context_management": "context_management is not supported by lmforge serve; remove it",
    "truncation": "truncation 'auto' is not supported by lmforge serve: a conversation over the context is refused, "
                  "never cut; send truncation 'disabled' or shorten it",
}
"""Fields of the Responses API that change the answer and lmforge does not implement: refused when set to anything
but their neutral value (null, false, 0, {}, [], ``truncation: "disabled"``), with these messages."""
_NEUTRAL = (None, False, 0, {}, [], "", "disabled")


class TextPart(Strict):
    """A message's content part: ``input_text`` (or ``output_text``, a previous reply's text; annotations ignored)."""

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(Strict):
    """A message item (``type`` may be left out, as the client's ``EasyInputMessage``)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(Strict):
    """A function call the model made (a previous response's ``function_call`` output item, sent back)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=64)
    arguments: str


class FunctionCallOutputItem(Strict):
    """The result of the call ``call_id``, computed by the client."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[TextPart]


def _item_tag(item: Any) -> str:
    """The union tag of an input item: ``type=`` its type (``message`` when left out), a tag that
    :func:`~lmforge.serve.api.parse` leaves out of the parameter it names (``input.0.content``)."""
    return "type=" + str(item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message"))


InputItem = Annotated[Union[Annotated[InputMessage, Tag("type=message")],
                            Annotated[FunctionCallItem, Tag("type=function_call")],
                            Annotated[FunctionCallOutputItem, Tag("type=function_call_output")]],
                      Discriminator(_item_tag)]


class FunctionTool(FunctionDef):
    """``{"type": "function", "name", "description", "parameters", "strict"}``: the Responses form of a chat tool."""

    type: Literal["function"]


class FunctionChoice(NamedFunction):
    type: Literal["function"]


class TextFormat(JsonSchemaFormat):
    """``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema", "name",
    "schema", "description", "strict"}``."""

    type: Literal["text", "json_object", "json_schema"]
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponseRequest(Strict):
    """``POST /v1/responses``."""

    model: str
    input: list[InputItem]  # a string is one user message

    @field_validator("input", mode="before")
    @classmethod
    def _one_message(cls, v: Any) -> Any:
        return [{"role": "user", "content": v}] if isinstance(v, str) else v
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=TOKENS_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)  # lmforge's extension, as on chat
    speculative: bool = True  # lmforge's extension, as on chat
    cache_salt: str | None = Field(default=None, min_length=1, max_length=SALT_MAX)  # vLLM's extension, as on chat
    stream: bool = False
    store: bool = True
    metadata: dict[Annotated[str, StringConstraints(max_length=64)],
                   Annotated[str, StringConstraints(max_length=512)]] | None = Field(default=None, max_length=16)
    user: str | None = None
    parallel_tool_calls: bool = True
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=256)
    include: list[str] | None = Field(default=None, max_length=16)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def logprobs(self) -> bool:
        """Whether the output text carries log-probabilities (``include`` names :data:`LOGPROBS`)."""
        return LOGPROBS in (self.include or ())

    @classmethod
    def refuse_unsupported(cls, data: dict[str, Any]) -> None:
        """400 naming a field, tool, item or content part lmforge does not implement (before the schema's own
        checks, so the refusal names what is unsupported rather than a failed union)."""
        refuse_unsupported(data, UNSUPPORTED, _NEUTRAL)
        if data.get("max_tool_calls") is not None:  # (0 is not neutral: it would forbid every call)
            raise unsupported("max_tool_calls is not supported by lmforge serve; remove it (limit calls with "
                              "tool_choice, or stop after the calls you want)", "max_tool_calls")
        text = data.get("text")
        if isinstance(text, dict) and text.get("verbosity") not in (None, "medium"):
            raise unsupported("text.verbosity is not supported by lmforge serve; remove it (or send 'medium')",
                              "text.verbosity")
        for k, tool in enumerate(data.get("tools") or () if isinstance(data.get("tools"), list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise unsupported(f"tools.{k}: tools of type {shown(kind, 40)} (built-in tools) are not supported by "
                                  "lmforge serve; give function tools {\"type\": \"function\", \"name\", "
                                  "\"parameters\"}", f"tools.{k}.type")
        choice = data.get("tool_choice")
        if isinstance(choice, dict) and isinstance(choice.get("type"), str) and choice["type"] != "function":
            raise unsupported(f"tool_choice of type {shown(choice['type'], 40)} is not supported by lmforge serve; "
                              "send none, auto, required or {\"type\": \"function\", \"name\"}", "tool_choice")
        items = data.get("input")
        for k, item in enumerate(items if isinstance(items, list) else ()):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if isinstance(kind, str) and kind not in ITEM_TYPES:
                raise unsupported(f"input.{k}: items of type {shown(kind, 40)} are not supported by lmforge serve; "
                                  f"send {', '.join(ITEM_TYPES)} items", f"input.{k}.type")
            key = "content" if kind == "message" else "output"
            parts = item.get(key) if isinstance(item, dict) else None
            for j, part in enumerate(parts if isinstance(parts, list) else ()):
                what = part.get("type") if isinstance(part, dict) else None
                if isinstance(what, str) and what not in ("input_text", "output_text"):
                    field = f"input.{k}.{key}.{j}"
                    raise unsupported(f"{field}: content of type {shown(what, 40)} is not supported by lmforge "
                                      "serve (its models read text only); send input_text parts", f"{field}.type")

    def check_supported(self) -> None:
        """400 for what the schema cannot say: an empty input, a json_schema format without its schema."""
        if not self.input:
            raise APIError(400, "input is empty; give a string or a list of items", "input")
        for k, name in enumerate(self.include or ()):
            if name != LOGPROBS:
                raise unsupported(f"include.{k}: {shown(name)} is not supported by lmforge serve (it has no tools or "
                                  f"reasoning to add); the one value served is {LOGPROBS!r}", f"include.{k}")
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
            raise APIError(400, "text.format of type json_schema needs schema (and a name)", "text.format.schema")


def new_id(prefix: str) -> str:
    """An id as OpenAI writes them: ``resp_...``, ``msg_...``, ``fc_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(req: ResponseRequest) -> list[dict[str, Any]]:
    """The request's input items as ``GET /v1/responses/{id}/input_items`` lists them: each with a new id and
    ``status: completed``, a message's content as one ``input_text`` part (``output_text`` for an assistant's)."""
    out: list[dict[str, Any]] = []
    for item in req.input:
        if isinstance(item, InputMessage):
            part = {"type": "output_text", "text": joined(item.content), "annotations": []} \
                if item.role == "assistant" else {"type": "input_text", "text": joined(item.content)}
            out.append({"id": new_id("msg"), "type": "message", "role": item.role, "status": "completed",
                        "content": [part]})
        elif isinstance(item, FunctionCallItem):
            out.append({"id": new_id("fc"), "type": "function_call", "status": "completed", "call_id": item.call_id,
                        "name": item.name, "arguments": item.arguments})
        else:
            out.append({"id": new_id("fco"), "type": "function_call_output", "status": "completed",
                        "call_id": item.call_id, "output": joined(item.output)})
    return out


def items_page(items: list[dict[str, Any]], query: Any) -> dict[str, Any]:
    """One page of ``items`` as the list endpoint answers (``query``: ``order`` ``asc``/``desc``, the default;
    ``limit`` 1 to 100, default 20; ``after``: an item id); APIError 400 naming a bad query parameter."""
    order, after, limit = query.get("order", "desc"), query.get("after"), query.get("limit", "20")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc', got {shown(order)}", "order")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise APIError(400, f"limit must be an integer from 1 to 100, got {shown(limit)}", "limit")
    items = items if order == "asc" else items[::-1]
    ids = [i["id"] for i in items]
    if after is not None and after not in ids:
        raise APIError(400, f"after names item {shown(after)}, which is not an input item of this response", "after")
    start = ids.index(after) + 1 if after is not None else 0
    data = items[start:start + int(limit)]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + len(data) < len(items)}


Origins = list[tuple[str, str]]
"""Where each chat message of a Responses request came from: the parameter and the words an error names it by
(``("input.3", "input.3 (user)")``, ``("instructions", "instructions")``, ``("previous_response_id", "message 2 of
the conversation of previous_response_id")``)."""


def conversation(req: ResponseRequest, history: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Origins]:
    """``history`` (the stored conversation of ``previous_response_id``) followed by ``req.input`` as chat messages
    (``{"role", "content", "tool_calls", "tool_call_id"}``, as a chat request sends them; a developer message is a
    system one); no instructions. Also where each message came from (:data:`Origins`)."""
    out = [dict(m) for m in history]
    where = [("previous_response_id", f"message {k} of the conversation of previous_response_id")
             for k in range(len(history))]
    for j, item in enumerate(req.input):
        if isinstance(item, InputMessage):
            out.append({"role": "system" if item.role == "developer" else item.role, "content": joined(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":  # the reply's text and its calls are one chat message
                out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", ()), call]}
                continue
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            out.append({"role": "tool", "content": joined(item.output), "tool_call_id": item.call_id})
        where.append((f"input.{j}", f"input.{j} ({item.role if isinstance(item, InputMessage) else item.type})"))
    return out, where


def _chat_messages(req: ResponseRequest, messages: list[dict[str, Any]],
                   where: Origins) -> tuple[list[dict[str, Any]], Origins]:
    """``messages`` (:func:`conversation`) as the chat format takes them: ``instructions`` and the opening
    system messages joined into one system message, first; a later system (developer) message read as user text,
    joined to the user message before it, else to the one after it, else standing as a user message."""
    lead = next((k for k, m in enumerate(messages) if m["role"] != "system"), len(messages))
    system = ([req.instructions] if req.instructions else []) + [m["content"] for m in messages[:lead]]
    out = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    origins = [("instructions", "instructions") if req.instructions else where[0]] if system else []
    joins: list[bool] = [False] * len(out)  # whether a message holds a developer's text (the next user joins it)
    for m, w in zip(messages[lead:], where[lead:]):
        developer = m["role"] == "system"
        if developer:
            m = {"role": "user", "content": m["content"]}
        if m["role"] == "user" and out and out[-1]["role"] == "user" and (developer or joins[-1]):
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + m["content"]}
            joins[-1] = True
            continue
        out.append(m)
        origins.append(w)
        joins.append(developer)
    return out, origins


def chat_request(req: ResponseRequest, messages: list[dict[str, Any]], where: Origins) -> ChatRequest:
    """The chat request that answers ``req`` over ``messages`` (:func:`conversation`, from ``where``); APIError
    400 in the Responses names when the two dialects' shared checks refuse it."""
    chat_messages, origins = _chat_messages(req, messages, where)
    fmt = req.text.format if req.text is not None else None
    choice, named = req.tool_choice, isinstance(req.tool_choice, FunctionChoice)
    return ChatRequest(
        max_tokens=req.max_output_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed, speculative=req.speculative,
        cache_salt=req.cache_salt, logprobs=(req.top_logprobs or 0) if req.logprobs() else None,
        messages=chat_messages, dialect=RESPONSES, origins=origins, tools=req.tools or None,
        tool_choice=None if named else choice, tool_name=choice.name if named else None,
        parallel_tool_calls=req.parallel_tool_calls,
        format=None if fmt is None or fmt.type == "text" else
        Format("json_schema", fmt.schema_, "text.format", "text.format.schema") if fmt.type == "json_schema" else
        Format("json_object", None, "text.format", "text.format"))
