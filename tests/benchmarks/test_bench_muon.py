"""benchmarks/bench_muon.py --quick: both optimizers train, evaluate and report; Muon keeps less state. Timings are
read unrounded from ``--json`` (a fast machine's optimizer step is shorter than the table's rounding)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _row(out: str, name: str) -> list[str]:
    return [c.strip() for c in next(x for x in out.splitlines() if x.startswith(f"| {name} |")).split("|")[1:-1]]


def test_bench_muon_quick(tmp_path):
    (tmp_path / "cwd").mkdir()
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_muon.py"), "--quick", "--seconds", "0.5",
                          "--json", str(tmp_path / "muon.json")], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path / "cwd")
    assert out.returncode == 0, out.stderr[-2000:]
    adamw, muon = _row(out.stdout, "adamw"), _row(out.stdout, "muon")
    for row in (adamw, muon):
        assert 0 < float(row[1].split()[0]) < 12 and int(row[3].split()[0]) >= 2  # bits/byte, steps
    # AdamW keeps two moments per matrix; Muon one momentum buffer for the blocks' matrices
    assert float(muon[5]) < float(adamw[5])
    figures = json.loads((tmp_path / "muon.json").read_text())
    assert all(r["step_ms"] > 0 for rs in figures["runs"].values() for r in rs)
    names = ("lmforge AdamW", "lmforge Muon (batched)", "lmforge Muon (reference)", "torch.optim.Muon + AdamW")
    for name in names:
        _row(out.stdout, name)  # printed
    assert set(figures["optimizer_step_ms"]) == set(names)
    assert all(len(ts) == 5 and all(t > 0 for t in ts) for ts in figures["optimizer_step_ms"].values())
    assert list((tmp_path / "cwd").iterdir()) == []  # nothing written into the working directory
