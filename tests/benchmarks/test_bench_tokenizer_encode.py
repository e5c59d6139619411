"""Smoke test of benchmarks/bench_tokenizer_encode.py: both tiktoken ways are timed and give lmforge's ids."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tiktoken")
ROOT = Path(__file__).resolve().parents[2]


def test_bench_tokenizer_encode_quick(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_tokenizer_encode.py"), "--quick",
                          "--cache-dir", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("identical ids") == 5
    for way in ("| tiktoken encode_batch |", "| tiktoken encode |", "| tiktoken loop of encode_ordinary |"):
        assert way in out.stdout
    winners = [line for line in out.stdout.splitlines() if line.startswith("faster tiktoken way: ")]
    assert len(winners) == 5
    assert all("encode" in w and float(w.rsplit(" is ", 1)[1].split("x")[0]) > 0 for w in winners)
