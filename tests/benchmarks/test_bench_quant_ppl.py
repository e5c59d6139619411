"""benchmarks/bench_quant_ppl.py --quick: a tiny trained run scored at every weight precision; float32 is the
baseline and int4 moves the loss most; the int8-activation rows (+a8) move it too, by a bounded amount."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("float32", "bfloat16", "float16", "int8", "int4", "int8+a8", "int4+a8")


def test_bench_quant_ppl_quick(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_quant_ppl.py"), "--quick"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    rows, ppl = {}, {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] in NAMES:
            rows[cells[0]], ppl[cells[0]] = float(cells[1]), float(cells[2])  # loss, perplexity
    assert set(rows) == set(NAMES)
    assert "| float32 |" in out.stdout and "+0.00% |" in out.stdout
    drift = {k: abs(v - rows["float32"]) for k, v in rows.items()}
    assert drift["int4"] > 0 and drift["int4"] >= max(drift["bfloat16"], drift["float16"])  # 4 bits round most
    assert 0 < drift["int8+a8"] < 0.05 and 0 < drift["int4+a8"] < 0.05 + drift["int4"]  # rounded inputs show
    # the plain int8/int4 rows multiply float32 activations (not the int8 default): each differs from its +a8 row
    assert ppl["int8"] != ppl["int8+a8"] and ppl["int4"] != ppl["int4+a8"]
    assert list(tmp_path.iterdir()) == []
