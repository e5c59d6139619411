"""Smoke test of benchmarks/bench_data_prepare.py: all four ways run warmed, in turn, on the same token count."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
ROOT = Path(__file__).resolve().parents[2]


def test_bench_data_prepare_quick(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_data_prepare.py"), "--quick"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "alternating rounds after a warm-up; identical token counts" in out.stdout
    for name in ("encode_batch (in memory)", "prepare (file -> shards)", "HF tokenizers encode_batch + numpy write"):
        assert name in out.stdout
    assert "prepare speed-up over HF tokenizers + numpy (warmed, ratio of medians)" in out.stdout
