"""A function call's schema (``serve.structured.call_schema``): a tool's ``parameters`` that reference their own
``$defs`` (or ``#``) still resolve once placed inside the call, by an independent validator and by llguidance."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from lmforge.generate.constraints import Grammars, json_grammar  # noqa: E402
from lmforge.serve.structured import call_schema  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from serve_helpers import byte_chat_tokenizer  # noqa: E402

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
SHAPE = {"type": "object", "$defs": {"P": POINT},
         "properties": {"a": {"$ref": "#/$defs/P"}, "more": {"type": "array", "items": {"$ref": "#"}}},
         "required": ["a"]}
PLAIN = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}


def _function(name: str, parameters: dict | None) -> SimpleNamespace:
    return SimpleNamespace(name=name, parameters=parameters)


@pytest.mark.parametrize("functions", [[_function("shape", SHAPE)],
                                       [_function("plain", PLAIN), _function("shape", SHAPE)]])
def test_references_inside_parameters_resolve_within_the_call(functions):
    schema = call_schema(functions)
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = {"name": "shape", "arguments": {"a": {"x": 1}, "more": [{"a": {"x": 2}, "more": []}]}}
    bad_ref = {"name": "shape", "arguments": {"a": {"x": "one"}}}  # #/$defs/P must still say x is an integer
    bad_self = {"name": "shape", "arguments": {"a": {"x": 1}, "more": [{"a": {}}]}}  # "#" is the parameters
    assert jsonschema.Draft202012Validator(schema).is_valid(ok)
    assert not jsonschema.Draft202012Validator(schema).is_valid(bad_ref)
    assert not jsonschema.Draft202012Validator(schema).is_valid(bad_self)
    assert SHAPE["properties"]["a"] == {"$ref": "#/$defs/P"}  # the request's own schema is not changed
    grammars = Grammars(byte_chat_tokenizer())
    try:
        grammars.compile(json_grammar(schema))  # old: "Pointer '/$defs/P' does not exist"
    finally:
        grammars.check.close()


def test_parameters_without_references_stay_inline():
    schema = call_schema([_function("plain", PLAIN), _function("none", None)])
    assert "$defs" not in schema
    assert schema["anyOf"][0]["properties"]["arguments"] == PLAIN
    assert schema["anyOf"][1]["properties"]["arguments"] == {"type": "object"}
