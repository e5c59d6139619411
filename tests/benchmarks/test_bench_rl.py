"""benchmarks/bench_rl.py runs in --quick mode: the rollout sides agree and both step tables are printed."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_rl_quick(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_rl.py"), "--quick"], capture_output=True,
                         text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "All sides produced the same replies: True" in out.stdout
    rows = {line.split("|")[1].strip(): line for line in out.stdout.splitlines() if line.startswith("| ")}
    rates = [float(rows[k].split("|")[3].replace(",", "")) for k in rows if k.startswith(("engine", "one at"))]
    assert len(rates) == 3 and all(r > 0 for r in rates)
    for side in ("full", "lora"):
        cells = [c.strip() for c in rows[side].split("|")[2:-1]]
        assert float(cells[0].split()[0]) > 0 and cells[1].endswith("%") and int(cells[4].replace(",", "")) > 0
    assert "LoRA / full: step time" in out.stdout
