"""The calculator tool: what runs between ``<|python_start|>`` and ``<|python_end|>``. No ``eval``/``exec``.

The expression is parsed with :mod:`ast` and walked over a whitelist: int and float literals, ``+ - * / // %
**`` and unary ``+ -``, with parentheses. Size bounds make time bounded without a timer: at most
:data:`MAX_CHARS` characters and :data:`MAX_NODES` syntax nodes, integers below ``10**MAX_DIGITS`` at every
step (``**`` is checked *before* it is computed), so each step is a small-number operation.

>>> calculate("12*7"), calculate("(1 + 2) / 4"), calculate("2**10 - -3"), calculate("7 // 2")
('84', '0.75', '1027', '3')
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Callable

__all__ = ["calculate", "MAX_CHARS", "MAX_NODES", "MAX_DIGITS"]

MAX_CHARS = 200
MAX_NODES = 64
MAX_DIGITS = 100
_LIMIT = 10 ** MAX_DIGITS

_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type, Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _fail(expr: str, why: str) -> ValueError:
    return ValueError(f"calculator: {expr!r:.80} {why}; a tool call must be arithmetic on numbers with "
                      "+ - * / // % ** and parentheses")


def _check_size(expr: str, x: float) -> float:
    if isinstance(x, float) and not math.isfinite(x) or abs(x) >= _LIMIT:
        raise _fail(expr, f"gives a number beyond 10**{MAX_DIGITS}")
    return x


def _eval(node: ast.AST, expr: str) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, complex or str
        return _check_size(expr, node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, expr))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left, expr), _eval(node.right, expr)
        if isinstance(node.op, ast.Pow) and a not in (0, 1, -1):
            # |a ** b| = 10 ** (b · log10|a|): refuse before computing a huge power
            if b * math.log10(abs(a)) >= MAX_DIGITS:
                raise _fail(expr, f"gives a number beyond 10**{MAX_DIGITS}")
        try:
            out = _BINARY[type(node.op)](a, b)
        except ZeroDivisionError:
            raise _fail(expr, "divides by zero") from None
        except OverflowError:
            raise _fail(expr, f"gives a number beyond 10**{MAX_DIGITS}") from None
        if isinstance(out, complex):
            raise _fail(expr, "gives a complex number")
        return _check_size(expr, out)
    if isinstance(node, ast.Constant):
        raise _fail(expr, f"uses {node.value!r:.20}, which is not a number")
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise _fail(expr, f"uses {what}, which is not allowed")


def calculate(expr: str) -> str:
    """The value of an arithmetic expression as text (ints exact, floats to 12 significant digits).

    ``ValueError`` for anything else: names, calls, attributes, strings, too long, too many operations,
    division by zero, or a number beyond ``10**MAX_DIGITS``.
    """
    if not isinstance(expr, str):
        raise ValueError(f"calculator: expected the expression as a string, got {type(expr).__name__}")
    if len(expr) > MAX_CHARS:
        raise _fail(expr, f"is {len(expr)} characters long (at most {MAX_CHARS})")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise _fail(expr, f"is not an expression ({e.msg})") from None
    n = sum(1 for _ in ast.walk(tree))
    if n > MAX_NODES:
        raise _fail(expr, f"has {n} syntax nodes (at most {MAX_NODES})")
    value = _eval(tree.body, expr)
    if isinstance(value, float):
        return f"{value:.12g}"
    return str(value)
