"""The OpenAI API's request schemas (pydantic, :class:`Strict`) and the builders of their answers (objects, chunks,
log-probabilities, usage). :func:`parse` validates a request: any problem is an :class:`APIError` (400) naming the
field. Fields that do not change the answer (``user``, ``metadata``, unknown names) are ignored; those that would and
are not implemented are refused (:data:`UNSUPPORTED`, each schema's ``check_supported``).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from itertools import accumulate
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from lmforge.common import is_unicode
from lmforge.generate.sampling import SEED_MAX, SEED_MIN
from lmforge.generate.scheduler import MAX_LOGPROBS
from lmforge.serve.errors import APIError, refuse_unsupported, shown, unsupported
from lmforge.serve.limits import SALT_MAX, TOKENS_MAX
from lmforge.serve.request import ChatRequest, Dialect, Format

__all__ = ["CHAT", "ChatCompletionRequest", "CompletionRequest", "EmbeddingRequest", "TokenizeRequest",
           "DetokenizeRequest", "parse"]

CHAT = Dialect({"tool.parameters": "tools.{k}.function.parameters"})
"""Chat Completions' names of the internal request's fields (the others are its own)."""


class Strict(BaseModel):
    """Every request model's base: unknown fields ignored, a value of the wrong type refused, never coerced
    (``"stream": "yes"``, ``"max_tokens": "5"`` or ``5.0``, ``"n": true``: 400s, as OpenAI's API answers them)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    def check_supported(self) -> None:
        """400 for what the schema cannot say: options lmforge does not implement, combinations that mean nothing."""


class _Request(Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=TOKENS_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)  # OpenAI's range: a signed 64-bit integer
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=128)
    speculative: bool = True
    """lmforge's extension: false turns prompt-lookup drafting off for this request (the same reply either way)."""
    cache_salt: str | None = Field(default=None, min_length=1, max_length=SALT_MAX)
    """vLLM's extension: the prefix cache's blocks are shared only among requests of one API key with the same salt
    (none: the key's shared space), so another salt neither reuses this request's prompt nor learns it from
    ``cached_tokens`` or the time to the first token."""

    def stops(self) -> list[str]:
        """The stop strings (at most 4, non-empty), as a list."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop takes up to 4 non-empty strings", "stop")
        return stops

    @classmethod
    def refuse_unsupported(cls, data: dict[str, Any]) -> None:
        """400 naming a field of :data:`UNSUPPORTED` set (``best_of`` 1 is the default), before the schema's checks."""
        refuse_unsupported({**data, "best_of": None} if data.get("best_of") == 1 else data, UNSUPPORTED, _NEUTRAL)
        if cls is CompletionRequest and data.get("response_format") not in (None, {"type": "text"}):
            raise unsupported("response_format is supported by /v1/chat/completions only; send the request there (as "
                              "messages)", "response_format")

    def sampling(self) -> dict[str, Any]:
        """The :class:`~lmforge.serve.request.Sampling` fields of this request."""
        return dict(max_tokens=self.limit(), temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                    n=self.n, stop=self.stops(), logprobs=self.n_logprobs(), speculative=self.speculative,
                    cache_salt=self.cache_salt)


class TextPart(Strict):
    """One part of a message's content given as a list (``{"type": "text", "text": ...}``)."""

    type: Literal["text"]
    text: str


def joined(content: str | list[Any] | None) -> str:
    """A message's text: a string as it is, a list of text parts joined (None: no text)."""
    return "".join(p.text for p in content) if isinstance(content, list) else content or ""


class CallFunction(Strict):
    name: str = Field(min_length=1, max_length=64)
    arguments: str


class ToolCall(Strict):
    """A function call in an assistant message (as the API returned it)."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: CallFunction


class ChatMessage(Strict):
    """A Chat Completions message (``content``: a string or a list of text parts)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=256)

    def as_chat(self) -> dict[str, Any]:
        """This message as the chat format's message (text content; tool calls and ids kept)."""
        out: dict[str, Any] = {"role": self.role, "content": joined(self.content)}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDef(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    """A function the model may call (``{"type": "function", "function": {name, description, parameters}}``)."""

    type: Literal["function"]
    function: FunctionDef


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema, strict}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """lmforge's (and vLLM's) extension: the reply matches a regular expression, or is one of a list of choices."""

    model_config = ConfigDict(extra="forbid", strict=True)
    regex: str | None = Field(default=None, min_length=1, max_length=10_000)
    choice: list[str] | None = Field(default=None, min_length=1, max_length=1000)


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=TOKENS_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    def check_supported(self) -> None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        rf, so = self.response_format, self.structured_outputs
        constrained = rf is not None and rf.type != "text"
        if constrained and so is not None and not self.tools:
            raise APIError(400, "give response_format or structured_outputs, not both", "structured_outputs")
        if (constrained or so is not None) and self.stops() and not self.tools:
            raise APIError(400, "stop cannot be combined with response_format or structured_outputs: a stop string "
                                "would cut the document short of its format; remove stop", "stop")
        if so is not None and (so.regex is None) == (so.choice is None):
            raise APIError(400, "structured_outputs takes one of regex or choice", "structured_outputs")
        if rf is not None and rf.type == "json_schema" and rf.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs json_schema: {name, schema}",
                           "response_format.json_schema")
        for k, m in enumerate(self.messages):
            if m.role == "tool" and m.tool_call_id is None:
                raise APIError(400, f"messages.{k}: a tool message needs tool_call_id, the id of the call it "
                                    "answers", f"messages.{k}.tool_call_id")
            if m.tool_calls is not None and m.role != "assistant":
                raise APIError(400, f"messages.{k}: only assistant messages have tool_calls",
                               f"messages.{k}.tool_calls")

    def chat_request(self) -> ChatRequest:
        """This request as the service runs it (the checks both dialects share raise here)."""
        rf, so, choice = self.response_format, self.structured_outputs, self.tool_choice
        fmt = None
        if rf is not None and rf.type == "json_schema":
            assert rf.json_schema is not None
            fmt = Format("json_schema", rf.json_schema.schema_, "response_format", "response_format.json_schema.schema")
        elif rf is not None and rf.type == "json_object":
            fmt = Format("json_object", None, "response_format", "response_format")
        elif so is not None:
            kind = "regex" if so.regex is not None else "choice"
            fmt = Format(kind, getattr(so, kind), "structured_outputs", f"structured_outputs.{kind}")
        named = isinstance(choice, NamedToolChoice)
        return ChatRequest(**self.sampling(), messages=[m.as_chat() for m in self.messages], dialect=CHAT,
                           tools=[t.function for t in self.tools] if self.tools else None,
                           tool_choice=None if named else choice, tool_name=choice.function.name if named else None,
                           parallel_tool_calls=self.parallel_tool_calls, format=fmt)

    def n_logprobs(self) -> int | None:
        """Alternatives per token for the scheduler (None: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    """``POST /v1/completions``: a raw prompt (one string) continued by the model."""

    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1, le=TOKENS_MAX)  # the OpenAI default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _alternatives(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError(f"on /v1/completions logprobs is how many alternatives to return per token (0 to "
                             f"{MAX_LOGPROBS}), not true/false")
        return v

    def n_logprobs(self) -> int | None:
        return self.logprobs

    def text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise APIError(400, f"prompt: give one string (got a list of {len(self.prompt)}); send several "
                                    "prompts as separate requests", "prompt")
            return self.prompt[0]
        return self.prompt

    def limit(self) -> int | None:
        return self.max_tokens


class EmbeddingRequest(Strict):
    """``POST /v1/embeddings``: texts (or token ids) to embed."""

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None

    def check_supported(self) -> None:
        if self.dimensions is not None:
            raise APIError(400, "dimensions is not supported: the embedding is the model's hidden size", "dimensions")
        items = self.items()
        if not items or any(len(x) == 0 for x in items) or len(items) > 256:
            raise APIError(400, "input must be 1 to 256 non-empty texts or token lists", "input")

    def items(self) -> list[str | list[int]]:
        """The inputs, each a text or a list of token ids (one list of ints is one input, as OpenAI reads it)."""
        if not isinstance(self.input, list) or self.input and all(isinstance(x, int) for x in self.input):
            return [self.input]  # type: ignore[list-item]
        return list(self.input)  # type: ignore[arg-type]


class TokenizeRequest(Strict):
    """``POST /tokenize``: a raw ``prompt``, or chat ``messages`` rendered as the chat endpoint renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = None

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give prompt (text) or messages (a chat), one of them", "prompt")


class DetokenizeRequest(Strict):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}

UNSUPPORTED: dict[str, str] = {
    "logit_bias": "logit_bias is not supported by lmforge serve; remove it",
    "presence_penalty": "presence_penalty is not supported by lmforge serve; remove it (or send 0)",
    "frequency_penalty": "frequency_penalty is not supported by lmforge serve; remove it (or send 0)",
    "best_of": "best_of is not supported by lmforge serve; send n for several samples",
    "suffix": "suffix (insertion) is not supported by lmforge serve; remove it",
    "echo": "echo is not supported by lmforge serve",
}
"""Fields of the OpenAI API that change the answer and lmforge does not implement: refused when set to anything
but their neutral value (null, 0, false, {}, 1 for ``best_of``), with these messages."""
_NEUTRAL = (None, 0, False, {}, "")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SCHEMA_FIELD = re.compile(r"(tools\.\d+\.(function\.)?parameters|response_format\.json_schema\.schema"
                           r"|text\.format\.schema)(?=\.|$)")


def _unencodable(data: Any) -> str | None:
    """The field (``tools.0.function.description``; a list of strings is named, not its item: ``stop``; a
    schema as a whole: ``tools.0.function.parameters``) of the first string in ``data``, key or value, that
    UTF-8 cannot encode (JSON may spell a lone surrogate, ``"\\ud800"``); None if every string encodes."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            stack += [(v, f"{path}.{k}" if path else k) for k, v in reversed(node.items())]
            stack += [(k, path) for k in reversed(node)]  # (read first; a key at fault names its dict)
        elif isinstance(node, list):
            stack += [(v, f"{path}.{i}") for i, v in reversed(list(enumerate(node)))]
        elif isinstance(node, str) and not is_unicode(node):
            field = _SCHEMA_FIELD.match(path)  # (a schema is one field: its inner keys are not named)
            return shown(field.group() if field else re.sub(r"(\.\d+)+$", "", path), 100, quote=False) or "body"
    return None


def parse(cls: type[BaseModel], body: bytes) -> Any:
    """``body`` (JSON) validated as ``cls``; an :class:`APIError` (400) naming the bad field otherwise."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply to parse; send a flat JSON object") from None
    except ValueError as e:  # (JSON and UTF-8 errors, and numbers over Python's 4,300-digit limit)
        raise APIError(400, f"the request body is not valid JSON ({str(e)[:200]}); send a JSON object") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    if hasattr(cls, "refuse_unsupported"):  # (its own table: chat and completions, /v1/responses)
        cls.refuse_unsupported(data)
    try:
        req = cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        parts, loc = [], err["loc"]
        if loc and loc[-1] == "[key]":  # (a dict's key at fault: name the dict, not the key a client wrote)
            loc = loc[:-2]
        for x in loc:  # field names and indices; stop at pydantic's union tags ("str", "list[str]")
            if isinstance(x, int) or (x.isidentifier() and x not in _TYPE_TAGS):
                parts.append(str(x))
            elif not x.startswith("type="):  # (a tagged union's member, "type=message", is named by its "type")
                break
        param = shown(".".join(parts), 100, quote=False) or None  # (a dict's keys are a client's text)
        got = "" if err["type"] == "missing" else f" (got {shown(err.get('input'))})"
        raise APIError(400, f"{param}: {err['msg']}{got}", param) from None
    if _SURROGATE_ESCAPE.search(body):  # (else no string in it can hold a lone surrogate: Python decoded it)
        bad = _unencodable(req.model_dump(by_alias=True))  # the fields read, not those ignored (user, metadata)
        if bad is not None:
            raise APIError(400, f"{bad}: the text is not valid Unicode (it holds a lone surrogate, which UTF-8 "
                                "cannot encode); send valid text", bad)
    req.check_supported()
    return req


# Answers (objects, chunks, usage, log-probabilities)
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """The OpenAI ``usage`` object; ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache gave."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_message(text: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """An assistant message: its text (None when it only calls functions) and its ``tool_calls``."""
    msg: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def answer(kind: str, rid: str, model: str, choices: list[dict[str, Any]], use: dict[str, int] | None = None,
           index: int = 0) -> dict[str, Any]:
    """A ``chat.completion``, ``chat.completion.chunk`` or ``text_completion`` (``kind``): ``choices`` (each
    choice's fields but its ``index``; they are numbered from ``index``), then the ``usage`` when given."""
    out: dict[str, Any] = {"id": rid, "object": kind, "created": int(time.time()), "model": model,
                           "choices": [{"index": k, **c} for k, c in enumerate(choices, index)]}
    if use is not None:
        out["usage"] = use
    return out


def chat_logprobs(lps: Any, token_bytes: Any) -> dict[str, Any]:
    """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}`` (``token_bytes(id)``
    gives a token's bytes; a token that is part of a UTF-8 character shows as its replacement text, its
    ``bytes`` exact)."""
    def entry(t: int, lp: float) -> dict[str, Any]:
        b = token_bytes(t)
        return {"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b)}

    return {"content": [{**entry(x.token, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]}
                        for x in lps]}


def completion_logprobs(lps: Any, token_bytes: Any, offset: int = 0) -> dict[str, Any]:
    """The completions endpoint's ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``."""
    tokens = [token_bytes(x.token).decode("utf-8", "replace") for x in lps]
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{token_bytes(t).decode("utf-8", "replace"): v for t, v in x.top} for x in lps],
            "text_offset": list(accumulate(map(len, tokens), initial=offset))[:-1]}


def sse(obj: Any, event: str | None = None) -> bytes:
    """One server-sent event: ``event: NAME`` when named, ``data: {json}`` and a blank line."""
    return ((f"event: {event}\n" if event else "") + "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n").encode()


SSE_DONE = b"data: [DONE]\n\n"
