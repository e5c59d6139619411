"""The C allocator's policy for a CPU training process: keep freed memory for the next step.

A training step allocates and frees the same activations, gradients and loss chunks every step. glibc's malloc
serves a block above its mmap threshold (128 KiB, rising with what is freed, to at most 32 MiB) with fresh pages
from the kernel and returns it on free, and trims the top of its heap whenever more than twice that is free, so
every step faults in tens of thousands of zeroed pages again (docs/benchmarks.md has the demo's count and time).
:func:`retain_freed_memory` raises both thresholds, so the process keeps what it freed and the next step reuses it:
the resident memory stays at the step's peak instead of falling back between steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

__all__ = ["retain_freed_memory", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

logger = logging.getLogger("lmforge")

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 1 << 30
"""Blocks below 1 GiB come from the heap (reused), not from fresh mappings (32 MiB where an older glibc refuses
more)."""
TRIM_THRESHOLD = (1 << 31) - 1
"""The heap's free top is kept up to 2 GiB (mallopt takes an int)."""


@functools.cache
def retain_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (:data:`MMAP_THRESHOLD`, :data:`TRIM_THRESHOLD`) for this process, once;
    ``True`` if they were set, ``False`` where the C library is not glibc (nothing changes there)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: another libc's mallopt takes other parameters)
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) or mallopt(_M_MMAP_THRESHOLD, 32 << 20))
    done = bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and done
    if done:
        logger.debug("malloc keeps freed memory (mmap threshold %d, trim threshold %d)", MMAP_THRESHOLD,
                     TRIM_THRESHOLD)
    return done
