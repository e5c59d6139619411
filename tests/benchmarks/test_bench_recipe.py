"""benchmarks/bench_recipe.py --quick: tokens to each target, the copy probe, alternating step times, the table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)  # ~40 s quiet; minutes on a shared, loaded machine
def test_bench_recipe_quick(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_recipe.py"), "--quick", "--variants",
                          "baseline", "batch-warmup", "--out", str(tmp_path / "out"), "--cache",
                          str(tmp_path / "cache"), "--json", str(tmp_path / "recipe.json")],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    trained = {r["variant"]: r for r in rows if "variant" in r}
    assert list(trained) == ["baseline", "batch-warmup"]
    assert trained["batch-warmup"]["settings"] == ["training.batch_warmup_steps=50"]
    for r in trained.values():  # the quick targets (100 and 50 bits/byte) are reached at the first evaluation
        assert r["stopped_at"] == 3 and [s for s, _, _ in r["curve"]] == [3]
        assert r["tokens_to"] == {"100.0": r["curve"][0][2], "50.0": r["curve"][0][2]}
        assert 0 < r["copy_first"] < 20 and 0 < r["copy_second"] < 20 and 0 < r["final_bpb"] < 20
    # the warm-up trains on fewer rows: 2, 3 and 3 of the tiny preset's 8 rows x 64 tokens in the first three steps
    assert trained["batch-warmup"]["tokens_to"]["50.0"] == 8 * 64 and trained["baseline"]["tokens_to"]["50.0"] == 3 * 8 * 64
    assert trained["baseline"]["final_bpb"] != trained["batch-warmup"]["final_bpb"]
    summary = json.loads((tmp_path / "recipe.json").read_text())["variants"]
    for name in (f"{n} @tiny" for n in trained):  # two alternating rounds of unrounded step times, the peak of the same run
        assert len(summary[name]["step_seconds"]) == 2 and all(t > 0 for t in summary[name]["step_seconds"])
        assert all(p > 0 for p in summary[name]["peak_flops"]) and summary[name]["seconds_to"]["50.0"][0] > 0
    assert "fp32 matmul peak" in out.stdout and "| batch-warmup @tiny | 1 | 512 (33%)" in out.stdout.replace(",", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "out", "recipe.json"]
