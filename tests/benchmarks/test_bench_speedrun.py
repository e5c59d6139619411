"""benchmarks/bench_speedrun.py --quick: train mode records steps to target and the curve; time mode and the table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.speedrun import RECIPE

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)  # ~30 s quiet; minutes on a shared, loaded machine
def test_bench_speedrun_quick(tmp_path):
    def bench(*args):
        out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_speedrun.py"), *args, "--quick",
                              "--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache")],
                             capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    bench("train", "--variants", "baseline", "muon+wsd", "--target", "100")
    rows = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["baseline", "muon+wsd"]
    assert rows[1]["settings"] == ["optimizer.name=muon", "optimizer.schedule=wsd", "optimizer.cooldown_frac=0.4"]
    for r in rows:
        assert r["steps_to_target"] == 3 and [s for s, _ in r["curve"]] == [3, 6] and 0 < r["final_bpb"] < 12
    assert rows[0]["final_bpb"] != rows[1]["final_bpb"]  # the settings were applied
    timed = bench("time", "--variants", "baseline", "muon")
    assert "| muon |" in timed and "fp32 matmul peak" in timed
    table = bench("table")
    on = " ".join(RECIPE) or "-"  # each row names the speedrun recipe it was measured on
    assert f"| baseline | {on} | 6 | 1 |" in table and f"| muon+wsd | {on} | 6 | 1 |" in table
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "out"]  # nothing in the working directory
