"""Smoke test of benchmarks/bench_chat.py: both sides hold the same conversation, every figure is measured (read
unrounded from ``--json``: a fast CPU's --quick run is shorter than the table's rounding) and the table is printed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_chat_quick_runs_and_matches_hf(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_chat.py"), "--quick", "--json",
                          str(tmp_path / "chat.json")], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "lmforge produced HF's tokens: True" in out.stdout
    rows = {line.split("|")[1].strip() for line in out.stdout.splitlines() if line.startswith("| ")}
    assert {"lmforge", "HF"} <= rows
    assert "HF / lmforge: time to first token" in out.stdout
    figures = json.loads((tmp_path / "chat.json").read_text())
    assert figures["same_tokens"] is True
    for side in ("lmforge", "HF"):
        # 2 timed rounds of 2 turns; a conversation's wall time per round
        assert len(figures["time_to_first_token_s"][side]) == len(figures["decode_tokens_per_s"][side]) == 4
        assert len(figures["conversation_wall_s"][side]) == 2
        for key in ("time_to_first_token_s", "decode_tokens_per_s", "conversation_wall_s"):
            assert all(x > 0 for x in figures[key][side]), (key, side, figures[key][side])
