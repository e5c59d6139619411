"""benchmarks/bench_train_step.py: both models start from the same weights and must agree on the first loss."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_train_step import LOSS_TOL, check_losses  # noqa: E402


def test_check_losses_exits_on_disagreement():
    check_losses([9.2, 9.1], [9.2 + LOSS_TOL / 2, 9.0], LOSS_TOL)  # within tolerance: returns
    with pytest.raises(SystemExit, match="not doing the same work"):
        check_losses([9.2, 9.1], [9.3, 9.1], LOSS_TOL)


def test_bench_train_step_quick_same_first_loss(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_train_step.py"), "--quick", "--no-memory"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("same weights, same batch"))
    diff = float(line.split("|diff| ")[1].split(",")[0])
    assert diff <= LOSS_TOL
    assert "lmforge / HF speed:" in out.stdout
    assert "HF optimizer: torch.optim.AdamW(fused=True)" in out.stdout  # the peer at its fastest unless told
