"""Smoke test of benchmarks/bench_serve.py: the real server against HF generate, a table row per concurrency."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_serve_quick_runs_and_matches_hf():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_serve.py"), "--quick", "--concurrency", "1", "4"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "server's greedy text equals HF generate's tokens: True" in out.stdout
    rows = [ln.split("|")[1:-1] for ln in out.stdout.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 4]
    for r in rows:
        assert float(r[3].strip().rstrip("x")) > 0
        p50, p95 = (float(x) for x in r[4].split("/"))
        assert 0 <= p50 <= p95
