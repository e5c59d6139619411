"""The calculator tool (lmforge.chat.tools): arithmetic and a few string methods only, bounded, no eval."""

import ast
import doctest
import inspect

import pytest

import lmforge.chat.format
import lmforge.chat.preview
import lmforge.chat.tools as tools
from lmforge.chat.tools import MAX_CHARS, calculate


@pytest.mark.parametrize("expr, want", [
    ("12*7", "84"), (" 12 * 7 ", "84"), ("(1 + 2) / 4", "0.75"), ("2**10 - -3", "1027"), ("7 // 2", "3"),
    ("7 % 3", "1"), ("-7 // 2", "-4"), ("+5", "5"), ("0.1 + 0.2", "0.3"), ("2 ** 0.5", "1.41421356237"),
    ("123456789 * 987654321", "121932631112635269"), ("10**99 // 10**98", "10"), ("2**-2", "0.25"),
    ("(-1) ** 10**9", "1"), ("1_000 + 1", "1001"),
])
def test_arithmetic(expr, want):
    assert calculate(expr) == want


@pytest.mark.parametrize("expr, want", [
    ("'-'.join(' honour'.strip())", "h-o-n-o-u-r"), ("' honour'.strip().upper()", "HONOUR"),
    ("'Honour'.lower()", "honour"), ("'honour'.count('o')", "2"), ("'honour'.count('z')", "0"),
    ("'a b'.count(' ')", "1"), ("''.join('abc')", "abc"), ("'x'", "x"), ("'honour'.count('o') * 3", "6"),
])
def test_string_methods(expr, want):
    assert calculate(expr) == want


def test_a_long_join_is_refused_before_it_is_joined():
    sep, text = "s" * 90, "t" * 90  # 90 + 89 * 90 = 8,100 characters: refused, from a 192-character call
    with pytest.raises(ValueError, match=r"gives a string longer than 1000 characters"):
        calculate(f"'{sep}'.join('{text}')")
    assert len(calculate(f"'{sep[:10]}'.join('{text}')")) == 90 + 89 * 10  # 980: within MAX_STRING


@pytest.mark.parametrize("expr, match", [
    ("__import__('os').system('true')", "uses Call"),
    ("a + 1", "uses Name"),
    ("(1).real", "uses Attribute"),
    ("'x' * 3", "uses the string 'x' as a number"),
    ("'x' + 'y'", "uses the string 'x' as a number"),
    ("-'x'", "uses the string 'x' as a number"),
    ("'x'.upper() * 2", "uses the string 'X' as a number"),
    ("'x'.format()", r"uses Call \(the method 'format'\)"),
    ("'x'.__class__", "uses Attribute"),
    ("len('x')", r"uses Call \(Name calls\)"),
    ("'x'.upper('y')", r"calls upper with other arguments than 0"),
    ("'x'.count()", r"calls count with other arguments than 1"),
    ("'x'.count(sub='x')", r"calls count with other arguments"),
    ("'x'.count(1)", "uses the number 1 as a string"),
    ("(1).upper()", "uses the number 1 as a string"),
    ("b'x'.upper()", "uses b'x', which is not a number"),
    ("True + 1", "uses True, which is not a number"),
    ("1j * 1j", "uses 1j, which is not a number"),
    ("[1, 2]", "uses List"),
    ("1 if 1 else 2", "uses IfExp"),
    ("1 < 2", "uses Compare"),
    ("1 << 3", "uses LShift"),
    ("~1", "uses Invert"),
    ("x = 1", "is not an expression"),
    ("1 +", "is not an expression"),
    ("1/0", "divides by zero"),
    ("5 % 0", "divides by zero"),
    ("0 ** -1", "divides by zero"),
    ("(-8) ** 0.5", "complex number"),
    ("9**9**9", r"beyond 10\*\*100"),
    ("10**100", r"beyond 10\*\*100"),
    ("2.0 ** 2000", r"beyond 10\*\*100"),
    ("0.5 ** -1000", r"beyond 10\*\*100"),
    ("1e308 * 10", r"beyond 10\*\*100"),
    ("10**60 * 10**60", r"beyond 10\*\*100"),
    ("+".join(["1"] * 40), "syntax nodes"),
    ("1" * (MAX_CHARS + 1), "characters long"),
])
def test_anything_else_is_refused_with_the_reason(expr, match):
    with pytest.raises(ValueError, match=f"calculator: .*{match}.*; a tool call must be arithmetic"):
        calculate(expr)


@pytest.mark.timeout(30, method="thread")  # a backstop: the guarded powers below take microseconds
@pytest.mark.parametrize("expr", ["10**10**10", "10**10**10**10", "9**9**9**9", "(-10)**10**10", "(-10)**101",
                                  "10**101", "10**1000", "2**333", "10.0**101", "0.1**-101", "99**51"])
def test_a_huge_power_is_refused_by_the_guard_before_it_is_computed(expr, monkeypatch):
    """The power guard alone refuses these: the real ``pow`` is never called with a result beyond the limit
    (a guard that exempted base 10, or allowed 1000x more digits, would compute them; for the first four that
    means minutes and gigabytes, so the spy refuses to compute instead of hanging)."""
    import math

    real = tools._BINARY[ast.Pow]
    computed = []

    def spy(a, b):
        if a not in (0, 1, -1) and b * math.log10(abs(a)) >= tools.MAX_DIGITS:
            raise AssertionError(f"{a!r:.20} ** {b!r:.20} was computed: the guard let it through")
        computed.append((a, b))
        return real(a, b)

    monkeypatch.setitem(tools._BINARY, ast.Pow, spy)
    with pytest.raises(ValueError, match=r"gives a number beyond 10\*\*100; a tool call must be arithmetic"):
        calculate(expr)
    assert calculate("10**99") == "1" + "0" * 99 and computed[-1] == (10, 99)  # the largest power allowed


def test_non_string_is_refused():
    with pytest.raises(ValueError, match="expected the expression as a string"):
        calculate(12)  # type: ignore[arg-type]


def test_the_calculator_never_calls_eval_or_exec():
    called = {n.func.id for n in ast.walk(ast.parse(inspect.getsource(tools)))
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not called & {"eval", "exec", "compile", "__import__"}


@pytest.mark.parametrize("module", [lmforge.chat.format, lmforge.chat.preview, tools])
def test_doctests_hold(module):
    failures, tried = doctest.testmod(module)
    assert failures == 0 and tried > 0


def test_a_literal_python_only_warns_about_is_refused_without_printing_a_warning():
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # every warning the calculator lets out is recorded
        with pytest.raises(ValueError, match=r"is not an expression \(invalid decimal literal\)"):
            calculate("9if 1 else 0")
        assert calculate("97+9") == "106"
    assert seen == []
