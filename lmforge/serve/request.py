"""One chat request, whichever OpenAI dialect it came in: :class:`ChatRequest`, run by the service.

Chat Completions (:mod:`~lmforge.serve.api`) and the Responses API (:mod:`~lmforge.serve.responses`) each validate
their own schema, so a schema error names the client's own field, then build a ChatRequest: from there the prompt,
the constraint, the limits and the sampled tokens are one path for both. A fault found on that path (a message the
chat renderer refuses, a schema the grammar compiler refuses, a prompt over the context) names what the client sent
through what its front end gave: the :class:`Dialect` and the messages' ``origins``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from lmforge.generate.sampling import SEED_MIN
from lmforge.serve.errors import APIError, shown

__all__ = ["ChatRequest", "Dialect", "Format", "Sampling"]


@dataclass(frozen=True)
class Dialect:
    """How a front end names the internal fields in errors: ``fields`` maps an internal name (``messages``,
    ``max_tokens``, ``tool.parameters`` with ``{k}`` for the tool's index) to its parameter; others keep theirs."""

    fields: Mapping[str, str] = field(default_factory=dict)

    def param(self, name: str, **at: Any) -> str:
        return self.fields.get(name, name).format(**at)


@dataclass(kw_only=True)
class Sampling:
    """How a request samples: per choice ``k`` of ``n`` a seed (:meth:`seed_of`), the stop strings, alternatives
    per token (``logprobs``, None: none), drafting (``speculative``), the prefix-cache salt the client sent."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    speculative: bool = True
    cache_salt: str | None = None

    def seed_of(self, k: int) -> int | None:
        """Choice ``k``'s seed: ``seed`` for the first (so ``n=1`` and choice 0 agree), then ``seed + k`` wrapped
        into the signed 64-bit range (distinct samples, each reproducible)."""
        return None if self.seed is None else (self.seed + k - SEED_MIN) % 2 ** 64 + SEED_MIN


@dataclass(frozen=True)
class Format:
    """The reply's format: ``kind`` ``json_schema`` (``value``: the schema), ``json_object``, ``regex`` or
    ``choice`` (``value``: the pattern or the list). ``field``: the request's parameter that asked for it,
    ``param``: the one holding ``value`` (errors about it name this one)."""

    kind: Literal["json_schema", "json_object", "regex", "choice"]
    value: Any
    field: str
    param: str


@dataclass(kw_only=True)
class ChatRequest(Sampling):
    """A chat request as the service runs it (module docstring). ``messages``: chat-format messages
    (:mod:`~lmforge.chat.format`); ``origins``: per message, the parameter it came from and the words an error names
    it by (None: errors name ``messages`` and keep the renderer's words). ``tools``: function definitions;
    ``tool_choice``: ``none``, ``auto``, ``required`` or None, ``tool_name`` the one function a choice names.
    The checks both dialects share raise :class:`~lmforge.serve.errors.APIError` in the dialect's names when
    the request is built."""

    messages: list[dict[str, Any]]
    dialect: Dialect = Dialect()
    origins: list[tuple[str, str]] | None = None
    tools: list[Any] | None = None
    tool_choice: str | None = None
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    format: Format | None = None

    def __post_init__(self) -> None:
        if self.tools and self.format is not None:
            raise APIError(400, f"{self.format.field} cannot be combined with tools: a tool call's arguments are "
                                "constrained to its function's schema already; send one", self.format.field)
        for k, f in enumerate(self.tools or ()):
            kind = (f.parameters or {}).get("type", "object")
            if kind != "object":
                param = self.dialect.param("tool.parameters", k=k)
                raise APIError(400, f"{param}: a function's parameters must be a JSON Schema of an object "
                                    f'("type": "object"), got type {shown(kind, 40)}', param)
        names = [f.name for f in self.tools or ()]
        if len(set(names)) != len(names):
            raise APIError(400, "tools: two functions have the same name", "tools")
        if (self.tool_choice not in (None, "none") or self.tool_name is not None) and not self.tools:
            raise APIError(400, "tool_choice needs tools: give the functions the model may call", "tool_choice")
        if self.tool_name is not None and self.tool_name not in names:
            raise APIError(400, f"tool_choice names function {shown(self.tool_name)}, which is not in tools "
                                f"({shown(', '.join(names), 200, quote=False)})", "tool_choice")

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat format renders them (``{"type": "function", "function": {...}}``)."""
        if not self.tools:
            return None
        return [{"type": "function", "function": f.model_dump(exclude={"type"}, exclude_none=True)} for f in self.tools]

    def message_error(self, k: int | None, text: str) -> APIError:
        """The 400 for a fault the chat renderer found: ``text`` says why, naming message ``k`` of
        :attr:`messages` ``message k`` or ``message k (role)`` (None: the conversation as a whole)."""
        if k is None or self.origins is None:
            param = self.dialect.param("messages")
            return APIError(400, f"{param}: {text}", param)
        param, label = self.origins[k]
        rest = text.removeprefix(f"message {k}").removeprefix(f" ({self.messages[k]['role']})")
        return APIError(400, label + rest, param)
