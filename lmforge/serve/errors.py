"""The error every route answers with: :class:`APIError`, in the OpenAI shape, and :func:`shown`, the bounded echo
of a client's value in its message."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["APIError", "error_body", "refuse_unsupported", "shown", "unsupported"]

MESSAGE_MAX = 800
"""The longest error message (characters): a last bound, each echoed value is cut by :func:`shown` first."""


def shown(value: Any, limit: int = 60, quote: bool = True) -> str:
    """A client's value as an error message echoes it: quoted (``repr`` of a string, JSON of anything else;
    ``quote=False``: the string as it is), cut to ``limit`` characters ending ``...``, so no value a client
    sends makes a long error."""
    if not quote:
        text = str(value)
    elif isinstance(value, str):
        text = repr(value)
    else:
        try:
            text = json.dumps(value, default=str)
        except ValueError:  # (an integer over Python's digit limit for str)
            text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:max(limit - 3, 0)] + "..."


class APIError(Exception):
    """An error answered with HTTP ``status`` and the OpenAI error object (:func:`error_body`)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        message = shown(message, MESSAGE_MAX, quote=False)
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``: the OpenAI error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def unsupported(message: str, param: str) -> APIError:
    """The 400 refusing a parameter lmforge does not implement (code ``unsupported_parameter``)."""
    return APIError(400, message, param, "unsupported_parameter")


def refuse_unsupported(data: dict[str, Any], messages: dict[str, str], neutral: tuple[Any, ...]) -> None:
    """:func:`unsupported` (``messages[name]``) for the first field ``name`` ``data`` sets to a non-neutral value."""
    for name, message in messages.items():
        if data.get(name) not in neutral:
            raise unsupported(message, name)
