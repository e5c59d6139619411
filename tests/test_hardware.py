"""lmforge.hardware: the one source of peak FLOP/s (configured, GPU datasheet, or measured matmul peak)."""

import platform
from pathlib import Path

import pytest
import torch

from lmforge.hardware import datasheet_peak, fit_matmul_size, matmul_peak_flops, mfu_denominator, peak_flops_for


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


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835), ("NVIDIA H200", 989),
    ("NVIDIA H200 NVL", 835), ("NVIDIA GH200 480GB", 989), ("NVIDIA A100-SXM4-80GB", 312),
    ("NVIDIA A100 80GB PCIe", 312), ("NVIDIA L40S", 362), ("NVIDIA L40", 181), ("NVIDIA L4", 121),
    ("NVIDIA A10G", 70), ("NVIDIA A10", 125), ("NVIDIA RTX A6000", 155), ("NVIDIA GeForce RTX 4090", 165),
    ("Tesla V100-SXM2-16GB", 125), ("Tesla T4", 65), ("NVIDIA RTX A1000", None), ("NVIDIA B200", None),
])
def test_datasheet_peak_matches_the_exact_model(name, tflops):
    """Variants are told apart (H100 SXM/PCIe/NVL), and a name inside another is no match (L4 in L40S, A10 in
    A10G/A100); an unknown GPU has no figure (MFU then needs training.peak_flops)."""
    assert datasheet_peak(name) == (None if tflops is None else tflops * 1e12)


def test_peak_flops_for_a_cuda_device_reads_its_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert peak_flops_for(torch.device("cuda"), None) == 756e12
    assert peak_flops_for(torch.device("cuda"), 1e12) == 1e12


def test_the_mfu_denominator_is_named(monkeypatch):
    """The training log and metrics.jsonl say what MFU divides by (the datasheet bf16 peak, or the configured one)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert mfu_denominator(torch.device("cuda"), None) == (989e12, "vs datasheet bf16 peak of NVIDIA H100 80GB HBM3")
    assert mfu_denominator(torch.device("cuda"), 2e14) == (2e14, "vs training.peak_flops")
    assert mfu_denominator(torch.device("cpu"), None) == (None, None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B200")
    assert mfu_denominator(torch.device("cuda"), None) == (None, None)  # unknown: no MFU, no name


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_the_mfu_denominator_is_measured_in_the_precision_the_run_trains_in(monkeypatch, native, expected):
    """training.dtype auto trains in bf16 where bf16 is native: its MFU must divide by the bf16 matmul peak (the
    fp32 peak read 113% on a CPU with avx512_bf16). The capability probe is forced, so this runs on any CPU."""
    import lmforge.hardware as hw
    from lmforge import report, speedrun

    seen: list[torch.dtype] = []
    monkeypatch.setattr(hw, "native_bf16", lambda device: native)
    monkeypatch.setattr(hw, "matmul_peak_flops", lambda device="cpu", n=2048, dtype=torch.float32, **kw:
                        seen.append(dtype) or 1e11)
    assert hw.train_peak_flops("auto", "cpu") == (1e11, "bf16" if native else "fp32")
    preset = next(iter(speedrun.PRESETS.values()))
    plan = speedrun._plan(preset, 512, Path("data"), Path("tokenizer.json"), torch.device("cpu"), ("steps", 3))
    name = "bf16" if native else "fp32"
    assert plan["peak_flops"] == 1e11 and plan["peak_dtype"] == name  # the speedrun report names it
    peak, source, dtype = report._peak({}, {"training": {"dtype": name}})  # a run card's fallback measurement
    assert (peak, dtype) == (1e11, name) and source.startswith(f"{name} matmul peak measured")
    old_card = {"hardware": {"host": platform.node(), "matmul_peak_flops": 5e10, "matmul_peak_dtype": "fp32",
                             "matmul_peak_source": "fp32 matmul peak measured"}}
    assert report._peak(old_card, {"training": {"dtype": name}})[0] == (5e10 if name == "fp32" else 1e11)
    assert seen == [expected] * (4 if native else 3)  # bf16: the old card's fp32 peak is not reused
