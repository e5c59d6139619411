"""fork() while other threads are inside lmforge._core: the child must not inherit a lock that a thread it does
not have was holding (the decode kernels' pool lock, a PretokenCounter's, an Encoder's cache pool). Before, 17 of
20 children hung forever on their first kernel call."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lmforge import _native

pytestmark = pytest.mark.skipif(not _native.available("linear_rows"), reason="C++ extension not built")

# Threads run kernels, count pre-tokens and encode in a loop (the GIL released inside each call) while the
# main thread forks 20 times; each child makes the same calls and exits. A child still alive at the deadline
# is hung: killed and counted.
SCRIPT = r"""
import os, signal, sys, threading, time
import numpy as np
from lmforge import _native

c = _native.core()
x, w = np.ones((4, 512), np.float32), np.ones((64, 512, 8), np.float32)
counter = c.PretokenCounter(c.PATTERN_GPT2, [])
enc = c.Encoder([bytes([b]) for b in range(256)], [], {}, c.PATTERN_GPT2)
data = b"hello world, these are words " * 20000
texts = ["hello world " * 50] * 64
stop = threading.Event()

def loop(fn):
    while not stop.is_set():
        fn()

def in_kernels():
    c.linear_rows(x, w, 0, np.zeros((4, 512), np.float32), 2)
    counter.total()
    enc.encode("hello world", False)

workers = [threading.Thread(target=loop, args=(f,)) for f in (
    lambda: c.linear_rows(x, w, 0, np.zeros((4, 512), np.float32), 2),
    lambda: counter.add(data, 2),
    lambda: enc.encode_batch(texts, 2, False))]
for t in workers:
    t.start()
pids = []
for _ in range(20):
    time.sleep(0.003)
    pid = os.fork()
    if pid == 0:
        in_kernels()
        os._exit(0)
    pids.append(pid)
stop.set()
for t in workers:
    t.join()
deadline, hung, failed = time.monotonic() + float(sys.argv[1]), 0, 0
for pid in pids:
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        hung += 1
    elif done[1] != 0:
        failed += 1
print(f"hung={hung} failed={failed}")
"""


def test_fork_while_threads_are_in_kernels_gives_children_that_run_them() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, "10"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "hung=0 failed=0"
