"""Smoke tests of benchmarks/bench_prefix.py and bench_speculative.py: their --quick runs, the counts they report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def quick(script: str, tmp_path: Path) -> dict:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--json", str(tmp_path / "f.json")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| off |" in out.stdout or "| torch on |" in out.stdout
    return json.loads((tmp_path / "f.json").read_text())


@pytest.mark.slow
def test_bench_prefix_quick_prefills_less_with_the_cache(tmp_path):
    f = quick("bench_prefix.py", tmp_path)["tiny"]
    off, on = (sum(f["prefilled_per_turn"][k][1:]) for k in ("off", "on"))
    assert on * 3 < off  # each later turn prefills its new message (and a partial block), not the history
    assert f["shared_work_ratio"] > 5 and f["shared_prefilled"]["on"] > 0


@pytest.mark.slow
def test_bench_speculative_quick_keeps_drafts_where_text_repeats(tmp_path):
    f = quick("bench_speculative.py", tmp_path)
    # the script itself exits when drafting changes the greedy tokens; a repeated passage always gets drafts
    assert f["tiny/repeat"]["drafted"] > 0  # the kernel path drafts (one C++ call checks them)
    for task in ("repeat", "free"):
        assert all(p <= 1.0 for p in f[f"tiny/{task}"]["passes_per_token"].values())
        assert set(f[f"tiny/{task}"]["speedup"]) == {"kernel", "torch"}
