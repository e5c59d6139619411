"""Smoke test of benchmarks/bench_generate.py: it runs end to end against HF and its fp32 decoder agrees."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_generate_quick_runs_and_matches_hf():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_generate.py"), "--quick", "--batch", "1", "2"],
                         capture_output=True, text=True, timeout=240, cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.split() and line.split()[0] in ("1", "2")]
    assert [r[0] for r in rows] == ["1", "2"]
    for r in rows:
        assert r[-1] == "True"  # lmforge fp32 produced HF's greedy tokens
        ratios = [float(c.rstrip("x")) for c in r if c.endswith("x")]
        assert len(ratios) >= 1 and all(x > 0 for x in ratios)
    assert "floor: weight products alone at 1 row(s)" in out.stdout
