"""benchmarks/bench_rl.py runs in --quick mode: the rollout sides agree, both step tables are printed and every
timing is measured (read unrounded from ``--json``: a fast machine's --quick step is shorter than the table's
rounding)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_rl_quick(tmp_path):
    (tmp_path / "cwd").mkdir()
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_rl.py"), "--quick", "--json",
                          str(tmp_path / "rl.json")], capture_output=True, text=True, timeout=600, cwd=tmp_path / "cwd")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "All sides produced the same replies: True" in out.stdout
    rows = {line.split("|")[1].strip() for line in out.stdout.splitlines() if line.startswith("| ")}
    assert {"full", "lora"} <= rows and "LoRA / full: step time" in out.stdout
    figures = json.loads((tmp_path / "rl.json").read_text())
    assert figures["same_replies"] is True and figures["reply_tokens"] > 0
    rollouts = figures["rollout_seconds"]
    assert len(rollouts) == 3 and all(k.startswith(("engine", "one at")) for k in rollouts)
    assert all(xs and all(x > 0 for x in xs) for xs in rollouts.values()), rollouts
    for side in ("full", "lora"):
        (run,) = figures["steps"][side]  # one round
        assert run["step"] > 0 and run["rollout"] > 0, run
        assert run["trainable"] > 0 and run["optimizer_bytes"] > 0
    assert list((tmp_path / "cwd").iterdir()) == []
