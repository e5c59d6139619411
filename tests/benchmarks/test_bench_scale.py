"""benchmarks/bench_scale.py: the activation-checkpointing child measures less memory kept for backward.

(The whole script, with its torchrun children, takes minutes on a loaded 2-core machine: run
``python benchmarks/bench_scale.py --quick`` by hand.)"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ac(tmp_path, *flag: str) -> dict:
    args = ["--child", "ac", "--vocab", "300", "--context", "32", "--d-model", "32", "--layers", "2", "--heads", "2",
            "--batch", "2", "--steps", "2", "--threads", "1", *flag]
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_scale.py"), *args], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_bench_scale_activation_checkpointing_child(tmp_path):
    off, on = _ac(tmp_path), _ac(tmp_path, "--ac")
    assert on["saved_mb"] < off["saved_mb"] / 3 and on["step_ms"] > 0 and off["step_ms"] > 0
    assert list(tmp_path.iterdir()) == []
