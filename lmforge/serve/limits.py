"""The server's request limits: the largest ``max_tokens`` and ``cache_salt`` a request may name, and how large a
JSON Schema (a ``response_format``, a tool's ``parameters``) may be before llguidance sees it.

llguidance compiles ``$ref``s and nesting recursively: a schema deep enough overflows its stack and kills the process
(:data:`~lmforge.generate.grammar_check.STACK_BYTES`). :func:`check_schema`, the ``check`` the server hands
:func:`~lmforge.generate.constraints.json_grammar`, refuses one over :class:`SchemaLimits` or admitting no finite
document.
"""

from __future__ import annotations

import collections
import itertools
import json
import urllib.parse
from dataclasses import dataclass
from typing import Any

from lmforge.generate.constraints import ConstraintError

__all__ = ["SALT_MAX", "TOKENS_MAX", "SchemaLimits", "check_schema", "local_pointer", "subschemas"]

TOKENS_MAX = 2 ** 31 - 1
"""The largest ``max_tokens`` a request may name (any context is far shorter; larger is refused by the schema)."""
SALT_MAX = 512
"""The longest ``cache_salt`` (characters): a random 256-bit salt is 43 in base64."""


@dataclass(frozen=True)
class SchemaLimits:
    """How large a JSON Schema the server takes (beyond: ``ConstraintError`` naming the limit).

    ``max_depth`` (far below llguidance's stack, module docstring) counts the schema objects on the longest path
    through nesting and ``$ref``s (a recursive group of definitions counts all its members); ``max_nodes`` the
    schema objects in all; ``max_properties`` one object's properties; ``max_enum`` one enum's values;
    ``max_bytes`` the schema as JSON text.
    """

    max_bytes: int = 200_000
    max_nodes: int = 5_000
    max_depth: int = 128
    max_properties: int = 1_000
    max_enum: int = 2_000


_ONE = ("additionalProperties", "additionalItems", "items", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def subschemas(node: dict[str, Any]) -> list[tuple[str, Any]]:
    """``node``'s subschemas as (JSON-pointer suffix, schema) pairs."""
    out: list[tuple[str, Any]] = [(f"/{k}", node[k]) for k in _ONE if isinstance(node.get(k), (dict, bool))]
    for k in _LIST:
        if isinstance(node.get(k), list):
            out += [(f"/{k}/{i}", v) for i, v in enumerate(node[k]) if isinstance(v, (dict, bool))]
    for k in _MAP:
        if isinstance(node.get(k), dict):
            out += [(f"/{k}/{_escape(name)}", v) for name, v in node[k].items() if isinstance(v, (dict, bool))]
    return out


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def local_pointer(ref: Any) -> str | None:
    """A local ``$ref``'s JSON pointer (``#/$defs/a`` -> ``/$defs/a``), None for any other reference."""
    if not isinstance(ref, str) or not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
        return None
    return "/".join(_escape(urllib.parse.unquote(p).replace("~1", "/").replace("~0", "~"))
                    for p in ref[1:].split("/"))


def check_schema(schema: dict[str, Any], limits: SchemaLimits = SchemaLimits()) -> None:
    """``ConstraintError`` if ``schema`` is over ``limits`` or admits no finite document (a ``$ref`` cycle with
    no way out: ``{"$ref": "#"}``, a required property that is the schema itself). Iterative: a schema nested
    deeper than Python's recursion limit is refused, not a crash."""
    nodes, pointers, index, kids = [schema], [""], {"": 0}, []  # kids: per node, its subschemas by pointer suffix
    for k, node in enumerate(nodes):  # breadth first: nodes grows as subschemas are found
        kids.append({})
        if isinstance(node, dict):
            props, enum = node.get("properties"), node.get("enum")
            if isinstance(props, dict) and len(props) > limits.max_properties:
                raise ConstraintError(f"the JSON Schema's object at #{pointers[k]} has {len(props):,} properties, "
                                      f"over this server's limit of {limits.max_properties:,}", limit="max_properties")
            if isinstance(enum, list) and len(enum) > limits.max_enum:
                raise ConstraintError(f"the JSON Schema's enum at #{pointers[k]} has {len(enum):,} values, over "
                                      f"this server's limit of {limits.max_enum:,}", limit="max_enum")
            for suffix, sub in subschemas(node):
                index[pointers[k] + suffix] = kids[k][suffix] = len(nodes)
                nodes.append(sub)
                pointers.append(pointers[k] + suffix)
            if len(nodes) > limits.max_nodes:
                raise ConstraintError(f"the JSON Schema has more subschemas than this server's limit of "
                                      f"{limits.max_nodes:,}; send a smaller one", limit="max_nodes")
    refs = [index.get(local_pointer(n.get("$ref"))) if isinstance(n, dict) else None for n in nodes]  # (no None key)
    edges = [list(kid.values()) + ([] if r is None else [r]) for kid, r in zip(kids, refs)]
    depth = _longest_path(edges)
    if depth > limits.max_depth:
        raise ConstraintError(f"the JSON Schema nests {depth:,} levels deep (through $ref), over this server's "
                              f"limit of {limits.max_depth}", limit="max_depth")
    if not _productive(nodes, kids, refs):
        raise ConstraintError("the JSON Schema admits no finite document (a $ref cycle with no way out like "
                              '{"$ref": "#"}, a required property that needs the schema itself, or one that is '
                              "false); give any recursion an end (an optional property, an empty array, an anyOf "
                              "branch)")
    size = len(json.dumps(schema))
    if size > limits.max_bytes:
        raise ConstraintError(f"the JSON Schema has {size:,} bytes, over this server's limit of {limits.max_bytes:,}; "
                              "send a smaller one", limit="max_bytes")


def _longest_path(edges: list[list[int]]) -> int:
    """The most nodes on a path from node 0 (an upper bound through cycles: each strongly connected group
    counts all its members). Tarjan's algorithm from node 0, iteratively: groups come out successors first."""
    n = len(edges)
    order, low, group = [-1] * n, [0] * n, [-1] * n  # a visited node without a group is on the stack
    counter, stack, work = itertools.count(), [0], [(0, iter(edges[0]))]
    longest: list[int] = []
    order[0] = low[0] = next(counter)
    while work:
        v, it = work[-1]
        for w in it:
            if order[w] < 0:
                order[w] = low[w] = next(counter)
                stack.append(w)
                work.append((w, iter(edges[w])))
                break
            if group[w] < 0:
                low[v] = min(low[v], order[w])
        else:
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == order[v]:
                g, members = len(longest), [stack.pop()]
                while members[-1] != v:
                    members.append(stack.pop())
                for w in members:
                    group[w] = g
                after = [longest[group[x]] for m in members for x in edges[m] if group[x] != g]
                longest.append(len(members) + max(after, default=0))
    return longest[group[0]]


def _productive(nodes: list[Any], kids: list[dict[str, int]], refs: list[int | None]) -> bool:
    """Whether the root admits a finite document: the least fixpoint of "a schema is productive when its
    ``$ref``, each ``allOf`` member, one ``anyOf``/``oneOf`` member, each required property and each item an
    array must have are" (other keywords are taken as satisfiable; llguidance judges them)."""
    need, met = [], set()  # per node, its conditions not met yet; the (node, condition) pairs met
    watch: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)  # id -> the conditions it meets
    for i, node in enumerate(nodes):
        t = _conditions(node, kids[i], refs[i])
        need.append(len(t))
        for j, ids in enumerate(t):
            for x in ids:
                watch[x].append((i, j))
    done, todo = [False] * len(nodes), [i for i in range(len(nodes)) if need[i] == 0]
    while todo:
        x = todo.pop()  # (each node comes once: when its last condition is met, or at the start with none)
        done[x] = True
        for i, j in watch[x]:
            if (i, j) not in met:
                met.add((i, j))
                need[i] -= 1
                if need[i] == 0:
                    todo.append(i)
    return done[0]


def _conditions(node: Any, kid: dict[str, int], ref: int | None) -> list[list[int]]:
    """What ``node`` needs to be productive (:func:`_productive`): conditions, each met by any one of its ids
    (``kid``: its subschemas by pointer suffix; ``ref``: its ``$ref``'s node)."""
    if not isinstance(node, dict):
        return [[]] if node is False else []
    t = [] if ref is None else [[ref]]
    t += [[x] for suffix, x in kid.items() if suffix.startswith("/allOf/")]
    for k in ("anyOf", "oneOf"):
        if isinstance(node.get(k), list):
            t.append([x for suffix, x in kid.items() if suffix.startswith(f"/{k}/")])
    for name in node["required"] if isinstance(node.get("required"), list) else ():
        if isinstance(name, str) and f"/properties/{_escape(name)}" in kid:
            t.append([kid[f"/properties/{_escape(name)}"]])
    low = node.get("minItems")  # the items an array must have
    prefix = "prefixItems" if isinstance(node.get("prefixItems"), list) else "items"
    n_prefix = len(node[prefix]) if isinstance(node.get(prefix), list) else 0
    if isinstance(low, int) and not isinstance(low, bool) and low > 0:
        for j in range(min(low, n_prefix + 1)):
            at = f"/{prefix}/{j}" if j < n_prefix else "/items"
            if at in kid:
                t.append([kid[at]])
    if "/contains" in kid and node.get("minContains", 1) != 0:
        t.append([kid["/contains"]])
    return t
