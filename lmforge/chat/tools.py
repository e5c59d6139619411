"""The calculator tool: what runs between ``<|python_start|>`` and ``<|python_end|>``. No ``eval``/``exec``.

:class:`ToolUse` watches one sequence's generated tokens and, when a call completes, gives the tokens to
force-feed (``<|output_start|>RESULT<|output_end|>``, from :meth:`ChatFormat.tool_output_ids`); a decoding loop
(:class:`~lmforge.chat.session.ChatSession`, a server's batched scheduler) keeps one per row.

The expression is parsed with :mod:`ast` and walked over a whitelist: int and float literals, ``+ - * / // %
**`` and unary ``+ -``, with parentheses; and string literals with the few string methods of
:data:`STRING_METHODS` (``upper``, ``lower``, ``strip``, ``count``, ``join``), as nanochat's calculator counts
letters with ``.count``: the chat tasks teach spelling and upper-casing through them (``'-'.join(' honour'.strip())``,
``' honour'.strip().upper()``), since a small model cannot see the letters inside its tokens. Strings take no
operators (no ``+`` or ``*``). Size bounds make time bounded without a timer: at most :data:`MAX_CHARS`
characters and :data:`MAX_NODES` syntax nodes, integers below ``10**MAX_DIGITS`` at every step (``**`` is checked
*before* it is computed), strings at most :data:`MAX_STRING` characters (``join`` is checked before it joins), so
each step is a small operation.

>>> calculate("12*7"), calculate("(1 + 2) / 4"), calculate("2**10 - -3"), calculate("7 // 2")
('84', '0.75', '1027', '3')
>>> calculate("'-'.join(' honour'.strip())"), calculate("' honour'.strip().upper()"), calculate("'honour'.count('o')")
('h-o-n-o-u-r', 'HONOUR', '2')
"""

from __future__ import annotations

import ast
import math
import operator
import warnings
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from lmforge.chat.format import ChatFormat

__all__ = ["calculate", "run_tool", "ToolUse", "MAX_CHARS", "MAX_NODES", "MAX_DIGITS", "MAX_STRING", "STRING_METHODS"]

MAX_CHARS = 200
MAX_NODES = 64
MAX_DIGITS = 100
MAX_STRING = 1000
_LIMIT = 10 ** MAX_DIGITS
STRING_METHODS: dict[str, int] = {"upper": 0, "lower": 0, "strip": 0, "count": 1, "join": 1}
"""The string methods a call may use, with their number of (string) arguments."""

_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type, Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _fail(expr: str, why: str) -> ValueError:
    return ValueError(f"calculator: {expr!r:.80} {why}; a tool call must be arithmetic on numbers with "
                      "+ - * / // % ** and parentheses, or a string's " + ", ".join(STRING_METHODS))


def _check_size(expr: str, x: float) -> float:
    if isinstance(x, float) and not math.isfinite(x) or abs(x) >= _LIMIT:
        raise _fail(expr, f"gives a number beyond 10**{MAX_DIGITS}")
    return x


def _number(node: ast.AST, expr: str) -> float:
    x = _eval(node, expr)
    if isinstance(x, str):
        raise _fail(expr, f"uses the string {x!r:.20} as a number")
    return x


def _string(node: ast.AST, expr: str) -> str:
    x = _eval(node, expr)
    if not isinstance(x, str):
        raise _fail(expr, f"uses the number {x!r:.20} as a string")
    return x


def _method(node: ast.Call, expr: str) -> str | int:
    """``STRING.method(ARGS)`` for a method of :data:`STRING_METHODS` (positional string arguments only)."""
    func = node.func
    if not isinstance(func, ast.Attribute) or func.attr not in STRING_METHODS:
        what = f"the method {func.attr!r}" if isinstance(func, ast.Attribute) else type(func).__name__ + " calls"
        raise _fail(expr, f"uses Call ({what}), which is not allowed")
    if node.keywords or len(node.args) != STRING_METHODS[func.attr]:
        raise _fail(expr, f"calls {func.attr} with other arguments than {STRING_METHODS[func.attr]} string(s)")
    text, args = _string(func.value, expr), [_string(a, expr) for a in node.args]
    if func.attr == "join" and len(args[0]) + max(0, len(args[0]) - 1) * len(text) > MAX_STRING:
        raise _fail(expr, f"gives a string longer than {MAX_STRING} characters")
    return getattr(str, func.attr)(text, *args)


def _eval(node: ast.AST, expr: str) -> float | str:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, complex or bytes
        return _check_size(expr, node.value)
    if isinstance(node, ast.Constant) and type(node.value) is str:
        return node.value
    if isinstance(node, ast.Call):
        return _method(node, expr)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_number(node.operand, expr))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _number(node.left, expr), _number(node.right, expr)
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
    """The value of an arithmetic expression or a string-method expression as text (ints exact, floats to 12
    significant digits, strings as they are).

    ``ValueError`` for anything else: names, other calls and attributes, operators on strings, too long, too
    many operations, division by zero, a number beyond ``10**MAX_DIGITS`` or a string beyond ``MAX_STRING``.
    """
    if not isinstance(expr, str):
        raise ValueError(f"calculator: expected the expression as a string, got {type(expr).__name__}")
    if len(expr) > MAX_CHARS:
        raise _fail(expr, f"is {len(expr)} characters long (at most {MAX_CHARS})")
    try:
        with warnings.catch_warnings():  # "9if 1 else 0" only warns in Python: refuse it, print nothing
            warnings.simplefilter("error", SyntaxWarning)  # the parser reports it as a SyntaxError then
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


def run_tool(expr: str) -> str:
    """The tool output for a call: the calculator's result, or ``"error: ..."`` (never raises for any text)."""
    try:
        return calculate(expr)
    except (ValueError, RecursionError, MemoryError) as e:  # RecursionError: a parser fed deep nesting
        return f"error: {e}"


class ToolUse:
    """Per-sequence tool-call state machine: feed it each generated token id, in order.

    ``feed`` returns None, except on the ``<|python_end|>`` that closes a ``<|python_start|>`` call: then the
    ids to force-feed next, ``<|output_start|>{result}<|output_end|>``, where the result is :func:`run_tool`
    of the call's text (an error string for a call that is not arithmetic or too large). The forced ids are
    not fed back into ``feed``. ``calls`` records ``(expression, output)`` of every completed call. A call
    holds at most ``max_call_tokens`` tokens; a longer one is answered with an error when it closes.

    >>> from lmforge.tokenizer import Tokenizer
    >>> from lmforge.chat.format import ChatFormat, add_chat_tokens
    >>> fmt = ChatFormat(add_chat_tokens(Tokenizer({i: bytes([i]) for i in range(256)}, [])))
    >>> use, sp = ToolUse(fmt), fmt.ids
    >>> [use.feed(t) for t in [sp["<|python_start|>"], ord("6"), ord("*"), ord("7")]]
    [None, None, None, None]
    >>> fmt.tokenizer.decode(use.feed(sp["<|python_end|>"]))
    '<|output_start|>42<|output_end|>'
    >>> use.calls
    [('6*7', '42')]
    """

    def __init__(self, fmt: "ChatFormat", max_call_tokens: int = 4 * MAX_CHARS) -> None:
        self.fmt = fmt
        self.start_id = fmt.ids["<|python_start|>"]
        self.end_id = fmt.ids["<|python_end|>"]
        self.max_call_tokens = max_call_tokens
        self.calls: list[tuple[str, str]] = []
        self._call: list[int] | None = None  # the open call's tokens, or None outside a call
        self._overflow = False

    @property
    def in_call(self) -> bool:
        """Whether a ``<|python_start|>`` is open (its ``<|python_end|>`` not yet seen)."""
        return self._call is not None

    def feed(self, token_id: int) -> list[int] | None:
        """Advance by one generated token; the ids to force-feed when it completes a call, else None."""
        if self._call is None:
            if token_id == self.start_id:
                self._call, self._overflow = [], False
            return None
        if token_id != self.end_id:
            if len(self._call) < self.max_call_tokens:
                self._call.append(token_id)
            else:
                self._overflow = True
            return None
        expr = self.fmt.tokenizer.decode(self._call)
        self._call = None
        if self._overflow:
            out = f"error: the call is longer than {self.max_call_tokens} tokens; a tool call must be a short " \
                  "arithmetic expression"
        else:
            out = run_tool(expr)
        self.calls.append((expr, out))
        return self.fmt.tool_output_ids(out)
