"""benchmarks/bench_muon.py --quick: both optimizers train, evaluate and report; Muon keeps less state."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _row(out: str, name: str) -> list[str]:
    return [c.strip() for c in next(x for x in out.splitlines() if x.startswith(f"| {name} |")).split("|")[1:-1]]


def test_bench_muon_quick(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_muon.py"), "--quick", "--seconds", "0.5"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    adamw, muon = _row(out.stdout, "adamw"), _row(out.stdout, "muon")
    for row in (adamw, muon):
        assert 0 < float(row[1].split()[0]) < 12 and int(row[3].split()[0]) >= 2  # bits/byte, steps
    # AdamW keeps two moments per matrix; Muon one momentum buffer for the blocks' matrices
    assert float(muon[5]) < float(adamw[5])
    for name in ("lmforge AdamW", "lmforge Muon (batched)", "lmforge Muon (reference)", "torch.optim.Muon + AdamW"):
        assert float(_row(out.stdout, name)[1].split()[0]) > 0
    assert list(tmp_path.iterdir()) == []  # nothing written into the working directory
