"""lmforge.hardware: the one source of peak FLOP/s (configured, GPU datasheet, or measured matmul peak)."""

import torch

from lmforge.hardware import fit_matmul_size, matmul_peak_flops, peak_flops_for


def test_fit_size_keeps_n_within_budget_and_shrinks_past_it():
    assert fit_matmul_size(512, torch.float32, max_seconds=60.0) == 512
    assert fit_matmul_size(8192, torch.float32, max_seconds=1e-6) == 256  # floor
    n = fit_matmul_size(4096, torch.float32, max_seconds=0.01)
    assert 256 <= n < 4096 and n & (n - 1) == 0


def test_matmul_peak_is_positive_and_finite():
    flops = matmul_peak_flops("cpu", 256, torch.float32, repeats=2)
    assert 0 < flops < 1e15


def test_peak_flops_for_prefers_the_configured_figure_and_has_none_for_a_cpu():
    assert peak_flops_for(torch.device("cpu"), 2.5e12) == 2.5e12
    assert peak_flops_for(torch.device("cpu"), None) is None
