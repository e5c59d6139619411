"""Structured output over the API: a chat request's format (``response_format``, ``structured_outputs``,
``text.format``) and ``tools`` turned into one row constraint
(:class:`~lmforge.generate.constraints.RowConstraint`), and function calls read back.

* ``response_format`` ``json_schema`` / ``json_object``, ``structured_outputs`` ``regex`` / ``choice``: the whole
  reply is one grammar region, closed by ``<|assistant_end|>``.
* ``tools``: the functions are rendered into the prompt (the chat format's tools block). A call is a region opened
  by ``<|call_start|>`` and closed by ``<|call_end|>`` whose text is ``{"name": NAME, "arguments": ARGS}`` with
  ``ARGS`` valid under that function's ``parameters`` schema; after a call only another call (when
  ``parallel_tool_calls``) or ``<|assistant_end|>`` may follow. ``tool_choice``: ``auto`` (the model decides),
  ``required`` or a named function (the reply starts with a call, to that function only), ``none`` (calls banned).
  Calls are captured (not text) and returned as ``tool_calls`` with ids ``call_...``.
"""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any

from lmforge.chat.format import ChatFormat
from lmforge.generate.constraints import (ConstraintError, Grammars, RowConstraint, choice_grammar, json_grammar,
                                          regex_grammar)
from lmforge.serve.errors import APIError
from lmforge.serve.limits import check_schema, local_pointer, subschemas
from lmforge.serve.request import ChatRequest

__all__ = ["call_schema", "parse_call", "reply_end", "request_constraint"]


def call_schema(functions: list[Any]) -> dict[str, Any]:
    """The JSON Schema of one call's text ``{"name": NAME, "arguments": ARGS}`` to any of ``functions``
    (``name`` and ``parameters``; no ``parameters``: any object)."""
    defs: dict[str, Any] = {}
    alternatives = []
    for k, f in enumerate(functions):
        arguments = f.parameters if f.parameters is not None else {"type": "object"}
        if _local_refs(arguments):  # its "#..." references must still resolve once it sits inside the call
            name = f"lmforge_function_{k}"
            defs[name] = copy.deepcopy(arguments)  # (within the schema limits, so its depth is bounded)
            for node in _local_refs(defs[name]):  # #/$defs/P -> #/$defs/NAME/$defs/P
                node["$ref"] = f"#/$defs/{name}" + node["$ref"][1:]
            arguments = {"$ref": f"#/$defs/{name}"}
        alternatives.append({"type": "object", "properties": {"name": {"const": f.name}, "arguments": arguments},
                             "required": ["name", "arguments"], "additionalProperties": False})
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    return {**schema, "$defs": defs} if defs else schema


def _local_refs(schema: Any) -> list[dict[str, Any]]:
    """Every subschema of ``schema`` (itself included) holding a local ``$ref`` (``#`` or ``#/...``)."""
    out, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if local_pointer(node.get("$ref")) is not None:
                out.append(node)
            stack += [sub for _, sub in subschemas(node)]
    return out


def _schema(schema: Any) -> Any:
    """The grammar of a JSON Schema within the server's limits (:func:`~lmforge.serve.limits.check_schema`)."""
    return json_grammar(schema, check_schema)


def _compiled(grammars: Grammars, make: Any, value: Any, param: str) -> Any:
    try:
        grammar = make(value)
        grammars.compile(grammar)
        return grammar
    except ConstraintError as e:
        what = f"{param}: {e}" + (f" (keyword {e.keyword!r})" if e.keyword else "")
        code = "unsupported_schema" if e.keyword else "schema_too_large" if e.limit else "invalid_schema"
        raise APIError(400, what, param, code) from None


_GRAMMARS = {"json_schema": _schema, "regex": regex_grammar, "choice": choice_grammar}


def request_constraint(req: ChatRequest, fmt: ChatFormat, grammars: Grammars) -> RowConstraint | None:
    """The row constraint of a chat request (None: unconstrained); APIError 400 naming the parameter (and the
    JSON-Schema keyword) for a schema, regex or choice list that cannot be used."""
    end, out = fmt.assistant_end_id, req.format
    if out is not None:
        g = (json_grammar({"type": "object"}) if out.kind == "json_object"
             else _compiled(grammars, _GRAMMARS[out.kind], out.value, out.param))
        return RowConstraint(grammars, g, close_id=end, max_regions=1,
                             source=out.param if out.kind == "json_schema" else out.field)
    if not req.tools:
        return None
    if not fmt.has_tools:
        raise APIError(400, "this model's tokenizer has no function-tool tokens, so it cannot call tools; "
                            "fine-tune it with lmforge sft (which adds them)", "tools", "tools_not_supported")
    start, close = fmt.ids["<|call_start|>"], fmt.ids["<|call_end|>"]
    if req.tool_choice == "none":
        return RowConstraint(grammars, None, start=start)
    for k, f in enumerate(req.tools):  # each schema alone first: the error names the function that is wrong
        if f.parameters is not None:
            _compiled(grammars, _schema, f.parameters, req.dialect.param("tool.parameters", k=k))
    functions = req.tools if req.tool_name is None else [f for f in req.tools if f.name == req.tool_name]
    g = _compiled(grammars, _schema, call_schema(functions), "tools")
    forced = req.tool_name is not None or req.tool_choice == "required"
    return RowConstraint(grammars, g, close_id=close, start=start, max_regions=None if req.parallel_tool_calls else 1,
                         after=[start, end], force=[start] if forced else (), source="tools")


def reply_end(job: Any, u: Any) -> str:
    """The text ``job``'s (a scheduler request's) last update ``u`` adds: a function call ``max_tokens`` cut short
    (finish ``length``) comes back as text, else ""; APIError 400 if its grammar failed while decoding (a schema
    llguidance compiles but cannot follow)."""
    c = job.constraint
    if c is not None and c.failure is not None and u.finish_reason == "error":
        raise APIError(400, f"{c.source}: {c.failure}; simplify it", c.source, "unsupported_schema")
    return c.partial_text() if c is not None and job.capture_regions and u.finish_reason == "length" else ""


def parse_call(text: str) -> dict[str, Any]:
    """A captured call's text (``{"name": ..., "arguments": {...}}``) as an OpenAI ``tool_calls`` entry with a new
    id; its arguments as a JSON text laid out as the chat format renders them."""
    obj = json.loads(text)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(obj["arguments"], ensure_ascii=False)}}
