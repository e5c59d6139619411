"""benchmarks/bench_interop.py --quick: every export and import row is timed and printed."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_interop_quick(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_interop.py"), "--quick"],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    for name in ("export hf", "export gguf f32", "export gguf q8_0", "lmforge import hf",
                 "lmforge open_run", "lmforge load model", "transformers from_pretrained"):
        row = next(x for x in out.stdout.splitlines() if x.startswith(f"| {name} |"))
        assert float(row.split("|")[2].split()[0]) > 0, row
    assert list(tmp_path.iterdir()) == []  # nothing written into the working directory
