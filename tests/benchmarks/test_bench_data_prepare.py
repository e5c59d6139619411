"""Smoke test of benchmarks/bench_data_prepare.py: all four ways run warmed, in turn, on the same token count."""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_corpus_text

pytest.importorskip("tokenizers")
ROOT = Path(__file__).resolve().parents[2]


def test_bench_data_prepare_quick(tmp_path):
    corpus = tmp_path / "corpus.txt"  # the suite makes its own data (the default corpus is a download)
    corpus.write_text(make_corpus_text(300, seed=4), encoding="utf-8")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_data_prepare.py"), "--quick", "--corpus",
                          str(corpus)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "alternating rounds after a warm-up; identical token counts" in out.stdout
    for name in ("encode_batch (in memory)", "prepare (file -> shards)", "HF tokenizers encode_batch + numpy write"):
        assert name in out.stdout
    assert "prepare speed-up over HF tokenizers + numpy (warmed, ratio of medians)" in out.stdout
