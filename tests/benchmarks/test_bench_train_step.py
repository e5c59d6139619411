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


def test_classify_names_each_part_of_the_step():
    from bench_train_step import classify

    assert classify("aten::mm", None) == "matmul" and classify("aten::addmm_", None) == "matmul"
    assert classify("aten::mm", "optimizer") == "optimizer: matmul (Newton-Schulz)"
    assert classify("aten::mul_", "optimizer") == "optimizer: other" and classify("aten::mul", "clip") == "gradient clipping"
    assert classify("aten::_scaled_dot_product_flash_attention_for_cpu_backward", None) == "attention"
    assert classify("aten::_to_copy", None) == "cast" and classify("aten::silu", None) == "other ops"


def test_bench_train_step_profile_quick(tmp_path):
    """--profile: the speedrun's own step (Muon) split by the profiler; the parts add up to the profiled step."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_train_step.py"), "--profile", "--quick",
                          "--no-hf", "--no-compiled", "--threads", "1"], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "the speedrun's RECIPE (Muon + AdamW groups, gradient clipping)" in lines[0]
    step_ms = float(next(x for x in lines if x.startswith("profiled:")).split(", ")[1].split(" ms")[0])
    rows = {x.split(" | ")[0][2:]: float(x.split(" | ")[1]) for x in lines
            if x.startswith("| ") and x.endswith("% |") and not x.startswith("| lmforge")}
    assert {"matmul", "attention", "optimizer: matmul (Newton-Schulz)", "optimizer: other"} <= set(rows)
    assert abs(sum(rows.values()) - step_ms) <= 0.02 * step_ms + 0.5
    assert any(x.startswith("| lmforge, the speedrun's step (Muon, eager) |") for x in lines)
