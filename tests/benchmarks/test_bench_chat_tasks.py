"""benchmarks/bench_chat_tasks.py --quick: both variants fine-tune and are scored per task."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)  # ~30 s quiet; minutes on a shared, loaded machine
def test_bench_chat_tasks_quick(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_chat_tasks.py"), "--quick"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {ln.split("|")[1].strip(): ln for ln in out.stdout.splitlines() if ln.startswith(("| plain", "| teach"))}
    assert set(rows) == {"plain", "teach"}
    header = next(ln for ln in out.stdout.splitlines() if ln.startswith("| variant"))
    assert all(t in header for t in ("arithmetic", "spelling", "counting", "uppercase", "identity", "calculator"))
    assert "teach arithmetic: wanted" in out.stdout
    assert list(tmp_path.iterdir()) == []
    assert "in-context copying of the base:" in out.stdout


def test_copy_probe_separates_a_copier_from_a_model_that_cannot_copy():
    import math

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_chat_tasks import copy_probe

    V, L = 50, 12

    def copier(x):  # knows the id `L` positions back exactly; uniform where there is none
        logits = torch.zeros(*x.shape, V)
        t = torch.arange(x.shape[1])
        back = x[:, (t + 1 - L).clamp(min=0)]
        logits[:, t >= L - 1] = torch.nn.functional.one_hot(back[:, t >= L - 1], V).float() * 100
        return logits

    first, second = copy_probe(copier, V, length=L)
    assert abs(first - math.log(V)) < 1e-5 and second < 1e-6
    first, second = copy_probe(lambda x: torch.zeros(*x.shape, V), V, length=L)
    assert abs(first - math.log(V)) < 1e-5 and abs(second - math.log(V)) < 1e-5
