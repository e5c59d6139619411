"""benchmarks/bench_quant_ppl.py --quick: a tiny trained run scored at every weight precision; float32 is the
baseline and int4 moves the loss most."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_quant_ppl_quick(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_quant_ppl.py"), "--quick"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] in ("float32", "bfloat16", "float16", "int8", "int4"):
            rows[cells[0]] = float(cells[1])  # loss
    assert set(rows) == {"float32", "bfloat16", "float16", "int8", "int4"}
    assert "| float32 |" in out.stdout and "+0.00% |" in out.stdout
    drift = {k: abs(v - rows["float32"]) for k, v in rows.items()}
    assert drift["int4"] > 0 and drift["int4"] >= max(drift["bfloat16"], drift["float16"])  # 4 bits round most
    assert list(tmp_path.iterdir()) == []
