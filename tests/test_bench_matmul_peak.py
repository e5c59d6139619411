"""benchmarks/bench_matmul_peak.py sizes its products to the machine: a slow dtype never runs for an hour."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_matmul_peak import fit_size, matmul_peak_gflops  # noqa: E402


def test_fit_size_keeps_n_within_budget_and_shrinks_past_it():
    assert fit_size(512, torch.float32, max_seconds=60.0) == 512
    assert fit_size(8192, torch.float32, max_seconds=1e-6) == 256  # floor
    n = fit_size(4096, torch.float32, max_seconds=0.01)
    assert 256 <= n < 4096 and n & (n - 1) == 0


def test_matmul_peak_is_positive_and_finite():
    g = matmul_peak_gflops(256, torch.float32, repeats=2)
    assert 0 < g < 1e6
