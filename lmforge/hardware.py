"""What a device can compute: its peak FLOP/s, the denominator of MFU, from one place.

Two sources, used in this order by :func:`peak_flops_for`: a figure the user configured
(``training.peak_flops``), else the datasheet bf16 peak of a known GPU. On a CPU there is no datasheet figure
worth dividing by, so :func:`matmul_peak_flops` measures the practical peak instead: the best of a few large
square products (the speedrun does this to report MFU, ``benchmarks/`` to put their figures in scale).
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import torch

logger = logging.getLogger("lmforge")

__all__ = ["GPU_PEAK_BF16", "datasheet_peak", "mfu_denominator", "peak_flops_for", "matmul_peak_flops",
           "train_peak_flops", "fit_matmul_size", "native_bf16", "resolve_train_dtype"]

# Dense bf16 tensor-core peak FLOP/s (no sparsity) by GPU model, from the vendors' datasheets, for MFU when not
# configured. A name is matched as whole words in ``torch.cuda.get_device_name`` ("L4" is not "L40", "A10" not
# "A10G" or "A100"), the first match wins: so a model's variants come before its plain name (an H100 reports
# "NVIDIA H100 80GB HBM3" for SXM, "NVIDIA H100 PCIe", "NVIDIA H100 NVL"). V100 and T4 have no bf16: fp16 figures.
GPU_PEAK_BF16: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12),
    ("H800 PCIe", 756e12), ("H800", 989e12),
    ("H200 NVL", 835e12), ("GH200", 989e12), ("H200", 989e12),
    ("A100", 312e12), ("A800", 312e12),
    ("L40S", 362e12), ("L40", 181e12), ("L4", 121e12),
    ("A10G", 70e12), ("A10", 125e12), ("A6000", 155e12),
    ("4090", 165e12), ("3090", 71e12), ("V100", 125e12), ("T4", 65e12),
)


def datasheet_peak(name: str) -> float | None:
    """The dense bf16 peak FLOP/s of the GPU called ``name`` (as CUDA reports it), or None if not in the table."""
    for key, flops in GPU_PEAK_BF16:
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", name):
            return flops
    return None


def mfu_denominator(device: Any, configured: float | None) -> tuple[float | None, str | None]:
    """Peak FLOP/s to divide by for MFU and its name, for the log line and ``metrics.jsonl`` (``mfu_basis``):
    ``configured`` if set ("vs training.peak_flops"), else a known GPU's datasheet bf16 peak ("vs datasheet bf16
    peak of <GPU>"), else ``(None, None)`` (no MFU). A measured peak reaches training as ``training.peak_flops``."""
    if configured:
        logger.info("MFU against training.peak_flops: %.1f TFLOP/s", configured / 1e12)
        return float(configured), "vs training.peak_flops"
    if getattr(device, "type", None) == "cuda":
        name = torch.cuda.get_device_name(device)
        flops = datasheet_peak(name)
        if flops is None:
            logger.info("unknown GPU %r: set training.peak_flops to report MFU", name)
            return None, None
        logger.info("MFU against the datasheet bf16 peak of %s: %.0f TFLOP/s", name, flops / 1e12)
        return flops, f"vs datasheet bf16 peak of {name}"
    return None, None


def peak_flops_for(device: Any, configured: float | None) -> float | None:
    """Peak FLOP/s to divide by for MFU: ``configured`` if set, else a known GPU's bf16 peak, else None (the figure
    of :func:`mfu_denominator`, which also names it)."""
    return mfu_denominator(device, configured)[0]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fit_matmul_size(n: int, dtype: torch.dtype, device: str | torch.device = "cpu", max_seconds: float = 10.0) -> int:
    """``n`` halved until one ``(n, n) @ (n, n)`` in ``dtype`` should take under ``max_seconds`` (floor 256).

    Some torch builds multiply bf16 on AVX2-only CPUs with a reference GEMM at ~1 GFLOP/s; this keeps a
    measurement in such a dtype from running for an hour.
    """
    device = torch.device(device)
    p = 256
    a = torch.randn(p, p, device=device).to(dtype)
    a @ a
    _sync(device)
    t0 = time.perf_counter()
    a @ a
    _sync(device)
    rate = 2 * p**3 / max(time.perf_counter() - t0, 1e-9)  # a small product underestimates the peak: safe side
    while n > p and 2 * n**3 / rate > max_seconds:
        n //= 2
    return n


def matmul_peak_flops(device: str | torch.device = "cpu", n: int = 2048, dtype: torch.dtype = torch.float32,
                      repeats: int = 30, max_seconds: float | None = None) -> float:
    """FLOP/s of the fastest of ``repeats`` timed ``(n, n) @ (n, n)`` products in ``dtype`` (after one warm-up).

    The best run, not the mean, so that other processes on a shared machine do not make the peak look low
    (and the MFU impossibly high); ~30 products of 2048² (a few seconds on a CPU) give the machine's quiet
    moments a chance to show. ``max_seconds``: shrink ``n`` first (:func:`fit_matmul_size`) so that one
    product takes at most this long; ``None`` takes ``n`` as given.
    """
    device = torch.device(device)
    if max_seconds is not None:
        n = fit_matmul_size(n, dtype, device, max_seconds)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    c = a @ b  # warm-up: thread pool, kernels
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        torch.matmul(a, b, out=c)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def _cpu_flags() -> set[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether ``device`` multiplies bfloat16 in hardware: a CUDA GPU that supports it, or a CPU with
    ``avx512_bf16`` or AMX (torch's CPU capability checks, else the ``/proc/cpuinfo`` flags).

    Elsewhere (an AVX2-only CPU, MPS) torch's bf16 matmul is far slower than fp32: a reference GEMM at ~1
    GFLOP/s against ~190 GFLOP/s in fp32 on a 2-core Zen 3.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if device.type != "cpu":
        return False
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if all(callable(c) for c in checks):
        return any(bool(c()) for c in checks)
    return bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})


_warned_slow_bf16: set[str] = set()


def train_peak_flops(dtype: str, device: str | torch.device = "cpu", **kwargs: Any) -> tuple[float, str]:
    """The measured matmul peak in the precision a run trains in (``training.dtype``, ``auto`` resolved by
    :func:`resolve_train_dtype`) and that precision's name: the MFU denominator where no datasheet figure
    applies. A bf16 step divided by the fp32 peak reads above 100% on a CPU with native bf16."""
    resolved = resolve_train_dtype(dtype, device)
    peak = matmul_peak_flops(device, dtype=torch.bfloat16 if resolved == "bf16" else torch.float32, **kwargs)
    return peak, resolved


def resolve_train_dtype(dtype: str, device: str | torch.device) -> str:
    """``training.dtype`` for ``device``: ``auto`` -> ``bf16`` where :func:`native_bf16`, else ``fp32``.

    An explicit ``bf16`` where bf16 is not native is kept (the numbers are right, only slow; tests of bf16
    numerics run on such machines), with one warning per device kind and process giving the two matmul rates
    measured now, so the cost is plain before a long run.
    """
    if dtype not in ("fp32", "bf16", "auto"):
        raise ValueError(f"training.dtype must be fp32, bf16 or auto, got {dtype!r}")
    device = torch.device(device)
    if dtype == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    if dtype == "bf16" and not native_bf16(device) and device.type not in _warned_slow_bf16:
        _warned_slow_bf16.add(device.type)
        bf16 = matmul_peak_flops(device, n=256, dtype=torch.bfloat16, repeats=2)
        fp32 = matmul_peak_flops(device, n=256, dtype=torch.float32, repeats=5)
        logger.warning("training.dtype=bf16 on a %s without native bf16 (no avx512_bf16 or AMX): bf16 matrix "
                       "products run at %.1f GFLOP/s here against %.1f in fp32 (256x256, measured now), so this "
                       "run will be about %.0fx slower than in fp32; training.dtype=auto picks the fast one",
                       device.type.upper(), bf16 / 1e9, fp32 / 1e9, max(1.0, fp32 / bf16))
    return dtype
