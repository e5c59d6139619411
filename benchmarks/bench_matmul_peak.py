"""The machine's limits: practical matmul peak (GFLOP/s of a large square matmul, the denominator of CPU MFU)
and memory read bandwidth (GB/s, the bound of batch-1 decoding).

    python benchmarks/bench_matmul_peak.py              # 4096² fp32 and bf16, and read bandwidth
    python benchmarks/bench_matmul_peak.py --n 2048     # quicker

Reported as the best of a few repeats (the machine is shared: the best run is the least disturbed one).
A dtype this CPU multiplies slowly (some torch builds fall back to a reference bf16 GEMM at ~1 GFLOP/s on
AVX2-only CPUs) is measured at a smaller size, so that the script never runs for an hour. The measurement is
:func:`lmforge.hardware.matmul_peak_flops`, the same the speedrun divides by for MFU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import read_bandwidth  # noqa: E402

from lmforge.hardware import fit_matmul_size, matmul_peak_flops


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
        n = fit_matmul_size(args.n, dtype)
        print(f"{n}² matmul {str(dtype).removeprefix('torch.'):>8}: "
              f"{matmul_peak_flops('cpu', n, dtype, args.repeats) / 1e9:7.1f} GFLOP/s")
    print(f"memory read bandwidth (sum of a 256 MiB fp32 tensor, best of 10): {read_bandwidth() / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
