"""benchmarks/bench_chat_tasks.py --quick: both variants fine-tune and are scored per task."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)  # ~30 s quiet; minutes on a shared, loaded machine
def test_bench_chat_tasks_quick(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_chat_tasks.py"), "--quick"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {ln.split("|")[1].strip(): ln for ln in out.stdout.splitlines() if ln.startswith(("| plain", "| teach"))}
    assert set(rows) == {"plain", "teach"}
    header = next(ln for ln in out.stdout.splitlines() if ln.startswith("| variant"))
    assert all(t in header for t in ("arithmetic", "spelling", "counting", "uppercase", "identity", "calculator"))
    assert "teach arithmetic: wanted" in out.stdout
    assert list(tmp_path.iterdir()) == []
    assert "in-context copying of the base:" in out.stdout

