"""benchmarks/bench_eval.py: lmforge and transformers score the same log-likelihoods before they are timed."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


def test_bench_eval_quick(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_eval.py"), "--quick"],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("same weights"))
    assert float(line.split("difference| ")[1].split()[0]) <= 1e-4
    assert "| lmforge |" in out.stdout and "lmforge / transformers speed:" in out.stdout
