"""lmforge.sizing: the fitted-ratio rule, the tokens a budget buys, the isoFLOP fit."""

from __future__ import annotations

import math

import pytest

from lmforge import sizing
from lmforge.sizing import CANDIDATES, Preset, choose, fit_ratio, params_of, plan_tokens, size

TINY = {"a": Preset(d_model=32, n_layers=1, n_heads=2, context_length=32, batch_size=4, lr=1e-3),
        "b": Preset(d_model=64, n_layers=2, n_heads=2, context_length=32, batch_size=4, lr=1e-3)}


def test_fit_ratio_finds_the_parabolas_minimum_and_says_when_it_extrapolates():
    points = [(r, (math.log(r) - math.log(2.5)) ** 2 + 1.5) for r in (0.25, 1.0, 4.0, 16.0)]
    fit = fit_ratio(points)
    assert fit["ratio"] == pytest.approx(2.5, rel=1e-9) and fit["loss"] == pytest.approx(1.5, abs=1e-12)
    assert fit["bracketed"] == 1.0
    falling = [(r, 2.5 - 0.5 * math.log(r) + 0.02 * math.log(r) ** 2) for r in (0.1, 0.3, 1.0, 3.0)]  # vertex: r=e^12.5
    assert fit_ratio(falling) == {"ratio": 3.0, "loss": falling[-1][1], "bracketed": 0.0}  # best at the edge
    with pytest.raises(ValueError, match="3 or more"):
        fit_ratio([(1.0, 2.0), (1.0, 2.1), (2.0, 2.0)])


def test_choose_takes_the_nearest_ratio_in_log_space():
    rows = [{"name": "big", "params": 100, "tokens": 30}, {"name": "small", "params": 10, "tokens": 25}]
    # ratios 0.3 and 2.5: |ln 0.3| = 1.20 > |ln 2.5| = 0.92 from 1.0, but from 0.5 0.3 is nearer
    assert choose(rows, 1.0)["name"] == "small" and choose(rows, 0.5)["name"] == "big"
    tie = [{"name": "x", "params": 20, "tokens": 40}, {"name": "y", "params": 10, "tokens": 20}]
    assert choose(tie, 1.0)["name"] == "y"  # the same ratio: the fewer parameters
    with pytest.raises(ValueError):
        choose([], 1.0)
    rows = [{**rows[0], "epochs": 1.0}, {**rows[1], "epochs": 9.0}]
    assert choose(rows, 1.0, max_epochs=4)["name"] == "big"  # "small" would repeat its data 9 times
    assert choose(rows, 1.0, max_epochs=0.5)["name"] == "big"  # none within: the fewest epochs


def test_plan_tokens_minutes_over_the_measured_step():
    p = CANDIDATES["d256x4"]
    assert plan_tokens(p, ("steps", 300), None) == (300, 300 * 16 * 256)
    assert plan_tokens(p, ("minutes", 8), 0.6)[0] == int(sizing.BUDGET_SHARE * 8 * 60 / 0.6) == 720
    assert plan_tokens(p, ("minutes", 0.01), 5.0)[0] == 10  # at least 10 steps
    with pytest.raises(ValueError, match="step time"):
        plan_tokens(p, ("minutes", 8), None)


def test_size_times_every_candidate_and_records_the_choice():
    timed = []

    def step(p: Preset) -> float:
        timed.append(p.d_model)
        return {32: 0.01, 64: 0.1}[p.d_model]

    rec = size(("minutes", 1.0), 300, 10**6, step, TINY, ratio=1.0)
    assert timed == [32, 64] and [r["name"] for r in rec["candidates"]] == ["a", "b"]
    a, b = rec["candidates"]
    assert a["steps"] == 5400 and b["steps"] == 540 and b["tokens"] == 540 * 4 * 32
    assert b["tokens_per_param"] == pytest.approx(b["tokens"] / params_of(TINY["b"], 300))
    assert b["flops_per_s"] == pytest.approx(b["flops_per_token"] * 128 / 0.1)
    want = min(rec["candidates"], key=lambda r: abs(math.log(r["tokens_per_param"])))
    assert rec["chosen"] == want["name"] and rec["text"].startswith(want["name"])
    assert "nearest 1 in log space" in rec["rule"] and a["epochs"] == a["tokens"] / 10**6
    steps_rec = size(("steps", 100), 300, 10**6, lambda p: pytest.fail("a budget in steps times nothing"), TINY,
                     ratio=0.5)
    assert [r["steps"] for r in steps_rec["candidates"]] == [100, 100] and steps_rec["candidates"][0]["step_seconds"] is None
    # a small training split: "a" would pass over it 2.2 times, more than max_epochs allows, so "b" is chosen
    assert size(("minutes", 1.0), 300, 10**6, step, TINY, ratio=100.0)["chosen"] == "a"
    capped = size(("minutes", 1.0), 300, 312_000, step, TINY, ratio=100.0, max_epochs=2.0)
    assert capped["chosen"] == "b" and capped["candidates"][0]["epochs"] > 2.0 >= capped["candidates"][1]["epochs"]
    assert "at most 2 times" in capped["rule"]


def test_family_names_a_shape():
    assert sizing.family("d192x3") == Preset(192, 3, 6, 256, 16, 2e-3)
    for bad in ("d100x2", "192x3", "d192", "d0x1", "d64x0"):
        with pytest.raises(ValueError, match="not d<width>x<depth>"):
            sizing.family(bad)


def test_the_candidates_grow_in_width_and_depth_and_include_the_demos_shape():
    from lmforge.speedrun import PRESETS

    assert CANDIDATES["d256x4"] == PRESETS["small"]
    params = [params_of(p, 4096) for p in CANDIDATES.values()]
    assert params == sorted(params) and sizing.TOKENS_PER_PARAM > 0
