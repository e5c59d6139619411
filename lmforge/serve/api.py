"""The OpenAI API's shapes: request schemas (pydantic), the error body, and response/chunk builders.

Requests are validated by :func:`parse`, which turns any problem into an :class:`APIError` (400) whose ``param``
names the field (``messages.0.role``, ``temperature``). Fields the OpenAI API has and lmforge does not use
(``user``, ``presence_penalty`` ...) are accepted and ignored; those that would change the answer and are not
supported (``n`` > 1, ``logprobs``, ``tools``) are refused with a 400 that says so.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lmforge.generate.sampling import SEED_MAX, SEED_MIN

__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "error_body", "parse"]


class APIError(Exception):
    """An error answered in the OpenAI shape: HTTP ``status`` and ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``: the OpenAI error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# --------------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------------
class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)  # OpenAI's range: a signed 64-bit integer
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1)
    logprobs: Any = None

    def stops(self) -> list[str]:
        """The stop strings (at most 4, non-empty), as a list."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop takes up to 4 non-empty strings", "stop")
        return stops

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def check_supported(self) -> None:
        """400 for options lmforge does not implement (instead of silently ignoring them)."""
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported: lmforge returns one choice per request; send n "
                                "separate requests (they are batched together)", "n")
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported by lmforge serve", "logprobs")


class TextPart(BaseModel):
    """One part of a message's content given as a list (``{"type": "text", "text": ...}``)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message: ``role`` and ``content`` (a string or a list of text parts)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise APIError(400, "tools are not supported: lmforge's chat models call their calculator tool "
                                "themselves (inside the reply)", "tools")

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    """``POST /v1/completions``: a raw prompt (one string) continued by the model."""

    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1)  # the OpenAI default for completions
    echo: bool = False

    def text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise APIError(400, f"prompt: give one string (got a list of {len(self.prompt)}); send several "
                                    "prompts as separate requests", "prompt")
            return self.prompt[0]
        return self.prompt

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported by lmforge serve", "echo")

    def limit(self) -> int | None:
        return self.max_tokens


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def parse(cls: type[_Request], body: bytes) -> Any:
    """``body`` (JSON) validated as ``cls``; an :class:`APIError` (400) naming the bad field otherwise."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e}); send a JSON object") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply to parse; send a flat JSON object") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        req = cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        parts = []
        for x in err["loc"]:  # field names and indices; stop at pydantic's union tags ("str", "list[str]")
            if isinstance(x, int) or (x.isidentifier() and x not in _TYPE_TAGS):
                parts.append(str(x))
            else:
                break
        param = ".".join(parts) or None
        got = "" if err["type"] == "missing" else f" (got {json.dumps(err.get('input'))[:60]})"
        raise APIError(400, f"{param}: {err['msg']}{got}", param) from None
    req.check_supported()
    return req


# --------------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_completion(rid: str, model: str, text: str, finish: str, prompt_tokens: int, n: int) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}],
            "usage": usage(prompt_tokens, n)}


def chat_chunk(rid: str, model: str, delta: dict[str, str], finish: str | None = None,
               use: dict[str, int] | None = None, choices: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                           "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
                           if choices else []}
    if use is not None:
        out["usage"] = use
    return out


def completion(rid: str, model: str, text: str, finish: str | None, use: dict[str, int] | None = None,
               choices: bool = True) -> dict[str, Any]:
    """A ``text_completion`` object: the whole answer, or one streamed chunk of it."""
    out: dict[str, Any] = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                           "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
                           if choices else []}
    if use is not None:
        out["usage"] = use
    return out


def sse(obj: Any) -> bytes:
    """One server-sent event: ``data: {json}`` and a blank line."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
