"""benchmarks/_common.py: rounds alternate between the tools, and the reported statistics are the stated ones."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _common import alternate, ratio, spread  # noqa: E402


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
