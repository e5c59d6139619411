"""benchmarks/bench_tokenizer_train.py: every peer's merges are compared with lmforge's, on the same work."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_tokenizer_train import _hf_bytes, agreement  # noqa: E402


def test_agreement_counts_prefix_and_overlap():
    assert agreement(["aa", "bb", "cc"], ["aa", "cc", "bb"]) == "same first 1 merges; vocabulary overlap 3/3 (100.00%)"
    assert agreement(["aa", "bb"], ["aa", "bb"]).startswith("same first 2 merges")
    assert "overlap 1/2 (50.00%)" in agreement(["aa", "bb"], ["aa", "xx"])


def test_hf_bytes_decodes_byte_level_tokens():
    assert _hf_bytes("Ġthe") == b" the"
    assert _hf_bytes("Ċ") == b"\n"


def test_bench_tokenizer_train_quick(tmp_path):
    pytest.importorskip("tokenizers")
    pytest.importorskip("rustbpe")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_tokenizer_train.py"), "--quick",
                          "--cache-dir", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = {line.split(":")[0]: line for line in out.stdout.splitlines() if line.startswith("- ")}
    assert set(lines) == {"- rustbpe", "- hf"}
    for line in lines.values():
        overlap = float(line.rsplit("(", 1)[1].rstrip("%)"))
        assert overlap > 80, line  # same corpus, same split: the vocabularies must mostly agree
