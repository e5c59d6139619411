"""benchmarks/bench_interop.py --quick: every export and import row is timed (read unrounded from ``--json``: a fast
machine's export is shorter than the table's rounding) and printed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_interop_quick(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_interop.py"), "--quick", "--json",
                          str(tmp_path / "interop.json")], capture_output=True, text=True, timeout=240, cwd=cwd)
    assert out.returncode == 0, out.stderr[-2000:]
    names = ("export hf", "export gguf f32", "export gguf q8_0", "lmforge import hf",
             "lmforge open_run", "lmforge load model", "transformers from_pretrained")
    for name in names:
        assert any(x.startswith(f"| {name} |") for x in out.stdout.splitlines()), name
    seconds = json.loads((tmp_path / "interop.json").read_text())["seconds"]
    assert set(seconds) == set(names)
    assert all(len(ts) == 2 and all(t > 0 for t in ts) for ts in seconds.values()), seconds  # 2 rounds each
    assert list(cwd.iterdir()) == []  # nothing written into the working directory
