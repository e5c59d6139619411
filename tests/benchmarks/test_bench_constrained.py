"""Smoke test of benchmarks/bench_constrained.py: schema validity, speed table, masks, n samples, determinism."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llguidance")
pytest.importorskip("jsonschema")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_constrained_quick_runs():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_constrained.py"), "--quick"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "schema-valid outputs: 24/24" in out.stdout
    assert "seeded request alone == in a batch of 8 mixed requests: True" in out.stdout
    rows = [ln.split("|")[1:-1] for ln in out.stdout.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 8] and all(float(r[1].split()[0]) > 0 for r in rows)
    assert "compile" in out.stdout and "n = 8 samples" in out.stdout
