"""benchmarks/_common.py: rounds alternate between the tools, and the reported statistics are the stated ones."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _common import alternate, figure, ratio, spread  # noqa: E402


def test_alternate_runs_tools_in_turn_after_warmup():
    calls: list[str] = []
    times = alternate({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3, warmup=1)
    assert calls == ["a", "b"] * 4
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for v in times.values() for t in v)


def test_alternate_refuses_zero_rounds():
    with pytest.raises(ValueError, match="rounds"):
        alternate({"a": lambda: None}, rounds=0)


def test_spread_and_ratio_use_medians():
    assert spread([3.0, 1.0, 2.0], ".1f") == "2.0 (1.0..3.0)"
    assert ratio([4.0, 40.0, 6.0], [1.0, 2.0, 3.0]) == pytest.approx(3.0)


def test_a_figure_faster_than_the_tables_rounding_is_not_printed_as_zero():
    # a --quick run on a fast CPU: 4 ms of wall time in a ".2f" seconds column, 40 us in a ".1f" ms column
    assert figure(0.004, ".2f") == "0.004" and figure(0.04, ".1f") == "0.04"
    assert spread([0.004, 0.003, 0.0049], ".2f") == "0.004 (0.003..0.0049)"
    assert spread([1e-7, 2e-7, 3e-7]) == "2e-07 (1e-07..3e-07)"
    assert figure(0.0, ".2f") == "0.00" and figure(1234.5, ",.0f") == "1,234"  # zero stays zero; wide figures as asked
