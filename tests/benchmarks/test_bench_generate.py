"""Smoke test of benchmarks/bench_generate.py: every HF configuration is a row, ratios are against the fastest."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_generate_quick_runs_and_matches_hf():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_generate.py"), "--quick", "--batch", "1", "2"],
                         capture_output=True, text=True, timeout=240, cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HF static+compile row skipped" in out.stdout  # --quick says so instead of hiding the row
    assert out.stdout.count("lmforge fp32 produced HF's tokens: True") == 2
    for batch in ("1", "2"):
        table = out.stdout.split(f"### batch {batch}")[1].split("lmforge fp32 produced")[0]
        rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| HF")
                or line.startswith("| lmforge")}
        assert {"HF fp32", "HF fp32 static", "HF bf16", "lmforge fp32"} <= set(rows)
        ratios = [float(line.split("|")[4].strip().rstrip("x")) for line in rows.values()]
        hf_ratios = [r for name, r in zip(rows, ratios) if name.startswith("HF")]
        assert max(hf_ratios) == pytest.approx(1.0) and all(r <= 1.0 for r in hf_ratios)  # against the fastest HF
        assert all(r > 0 for r in ratios)
    assert "floor: weight products alone at 1 row(s)" in out.stdout
