"""retain_freed_memory: a freed block is reused, not faulted in again (in a child: the setting is process-wide)."""

import subprocess
import sys

import pytest

CHILD = r"""
import resource, sys, torch
from lmforge.train.allocator import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
for _ in range(5):  # the heap settles: glibc's own threshold rises past the block, and an aligned block may take a
    torch.empty(48 << 20, dtype=torch.uint8).fill_(1)  # few fresh places before freed ones fit it (measured: <= 4)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    torch.empty(48 << 20, dtype=torch.uint8).fill_(1)  # 48 MiB: above glibc's default mmap ceiling (32 MiB)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_retained_memory_is_reused_without_page_faults():
    pages = (48 << 20) // 4096
    assert _faults("default") >= 4 * pages  # fresh pages for every block
    assert _faults("retain") < pages  # settled: every block reuses freed memory
