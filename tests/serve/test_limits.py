"""The server's JSON-Schema limits (:mod:`lmforge.serve.limits`), checked before llguidance sees a schema: schemas
over a limit are refused naming it, and schemas with no finite document are refused."""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance")

from lmforge.generate.constraints import ConstraintError, json_grammar  # noqa: E402
from lmforge.serve.limits import SchemaLimits, check_schema  # noqa: E402
from tests.generate.test_constraints_limits import ref_chain  # noqa: E402


def test_schemas_over_the_limits_are_refused_naming_the_limit():
    cases = {"max_depth": [ref_chain(3000), ref_chain(2000, arrays=True), ref_chain(200)],
             "max_properties": [{"type": "object", "properties": {f"p{i}": {} for i in range(13_000)}}],
             "max_enum": [{"enum": list(range(3000))}],
             "max_nodes": [{"anyOf": [{"type": "integer"}] * 6000}],
             "max_bytes": [{"type": "object", "properties": {f"p{i}": {"const": "x" * 300} for i in range(900)}}]}
    for limit, schemas in cases.items():
        for schema in schemas:
            with pytest.raises(ConstraintError, match=f"limit of {getattr(SchemaLimits(), limit):,}") as e:
                json_grammar(schema, check_schema)
            assert e.value.limit == limit
    for fine in (ref_chain(100), ref_chain(50, arrays=True), {"anyOf": [{"type": "integer"}] * 100}):
        json_grammar(fine, check_schema)  # within the limits
    check_schema(ref_chain(30), SchemaLimits(max_depth=40))
    with pytest.raises(ConstraintError, match="32 levels"):
        check_schema(ref_chain(30), SchemaLimits(max_depth=31))  # root + 31 definitions


def test_schemas_that_admit_no_finite_document_are_refused():
    none = [{"$ref": "#"},
            {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
            {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
            {"type": "object", "properties": {"a": False}, "required": ["a"]},
            {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
            {"anyOf": [{"$ref": "#"}, {"allOf": [{"type": "string"}, {"$ref": "#"}]}]}]
    for schema in none:
        with pytest.raises(ConstraintError, match="admits no finite document"):
            json_grammar(schema, check_schema)
    some = [{"type": "object", "properties": {"a": {"$ref": "#"}}},  # a optional: {} ends it
            {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
             "required": ["v", "kids"]},
            {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
            {"$defs": {"a~b/c": {"type": "integer"}}, "$ref": "#/$defs/a~0b~1c"}]
    for schema in some:
        json_grammar(schema, check_schema)
