"""The machine's practical matmul peak: GFLOP/s of a large square matmul, the denominator of CPU MFU.

    python benchmarks/bench_matmul_peak.py              # 4096² fp32 and bf16
    python benchmarks/bench_matmul_peak.py --n 2048     # quicker

Reported as the best of a few repeats (the machine is shared: the best run is the least disturbed one).
A dtype this CPU multiplies slowly (some torch builds fall back to a reference bf16 GEMM at ~1 GFLOP/s on
AVX2-only CPUs) is measured at a smaller size, so that the script never runs for an hour.
"""

from __future__ import annotations

import argparse
import time

import torch


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def fit_size(n: int, dtype: torch.dtype, device: str = "cpu", max_seconds: float = 10.0) -> int:
    """``n`` halved until one ``(n, n) @ (n, n)`` in ``dtype`` should take under ``max_seconds`` (floor 256)."""
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


def matmul_peak_gflops(n: int = 4096, dtype: torch.dtype = torch.float32, repeats: int = 5, device: str = "cpu",
                       max_seconds: float | None = 10.0) -> float:
    """Best GFLOP/s of ``(n, n) @ (n, n)`` over ``repeats`` timed runs (after one warm-up).

    ``n`` shrinks (see :func:`fit_size`) when ``dtype`` is so slow here that one product would take longer
    than ``max_seconds``; ``None`` takes ``n`` as given (a caller that already fitted it).
    """
    if max_seconds is not None:
        n = fit_size(n, dtype, device, max_seconds)
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
    return 2 * n**3 / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096, help="matrix size")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads: {torch.get_num_threads()}")
    for dtype in (torch.float32, torch.bfloat16):
        n = fit_size(args.n, dtype)
        print(f"{n}² matmul {str(dtype).removeprefix('torch.'):>8}: "
              f"{matmul_peak_gflops(n, dtype, args.repeats, max_seconds=None):7.1f} GFLOP/s")


if __name__ == "__main__":
    main()
