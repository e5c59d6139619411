"""Smoke test of benchmarks/bench_chat.py: both sides hold the same conversation and the table is printed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_chat_quick_runs_and_matches_hf():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_chat.py"), "--quick"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "lmforge produced HF's tokens: True" in out.stdout
    rows = {line.split("|")[1].strip(): line for line in out.stdout.splitlines() if line.startswith("| ")}
    assert {"lmforge", "HF"} <= set(rows)
    for name in ("lmforge", "HF"):
        ttft, rate, wall = (float(c.split()[0].replace(",", "")) for c in rows[name].split("|")[2:5])
        assert ttft > 0 and rate > 0 and wall > 0
    assert "HF / lmforge: time to first token" in out.stdout
