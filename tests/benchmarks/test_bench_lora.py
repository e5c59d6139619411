"""benchmarks/bench_lora.py: lmforge LoRA and PEFT start from the same weights and adapters and agree on the first loss."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
ROOT = Path(__file__).resolve().parents[2]


def test_bench_lora_quick_same_first_loss(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_lora.py"), "--quick"],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("same weights, same batch"))
    assert float(line.split("|diff| ")[1]) <= 1e-4
    rows = [x for x in out.stdout.splitlines() if x.startswith("| lmforge LoRA |")]
    assert rows and "(11.9%)" in rows[0]  # rank 8 on every projection of the quick model: 20,480 of 172,352
    assert "PEFT / lmforge LoRA:" in out.stdout
