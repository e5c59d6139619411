"""benchmarks/bench_sft.py runs in --quick mode and prints its three comparisons."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_sft_quick(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_sft.py"), "--quick"], capture_output=True,
                         text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| pretrain", "| sft", "| lora"))]
    assert len(rows) == 3
    assert "SFT / pretraining tokens/s:" in out.stdout
    line = next(x for x in out.stdout.splitlines() if x.startswith("LoRA / full SFT:"))
    share = float(line.split("optimizer state ")[1].split("= ")[1].split("%")[0])
    assert 0 < share < 100  # adapters are a fraction of the model
