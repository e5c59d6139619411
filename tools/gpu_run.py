"""The GPU check's command stages (``tools/gpu_check.py`` runs them): pytest, and the speedrun, each reported as a
JSON line appended to ``--result`` (exit code, counts, figures), like the Python stages.

    python tools/gpu_run.py pytest [PYTEST ARGS...] --result FILE
    python tools/gpu_run.py speedrun CORPUS OUT_DIR DEVICE [--quick] --result FILE
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from gpu_failures import PREFIX  # noqa: E402
from gpu_train import emit  # noqa: E402


def pytest(args: list[str], result: str) -> int:
    """Run pytest with ``args``, its output passed through as it comes (a stage cut short keeps it in the log);
    its counts from the summary line, the failed tests as they fail (``gpu_failures``), each also in ``result`` at
    once, so that a run killed at its cap still names them."""
    path = os.pathsep.join(filter(None, [str(ROOT / "tools"), os.environ.get("PYTHONPATH")]))  # finds gpu_failures
    env = dict(os.environ, PYTHONPATH=path)
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "gpu_failures", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    last, failed = "", []
    for line in p.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        test = line[len(PREFIX):].strip() if line.startswith(PREFIX) else None
        if test is not None and test not in failed:  # once, were xdist to echo it
            failed.append(test)
            emit(result, {"kind": "pytest_failure", "test": test, "ok": False})
        last = line.strip() or last
    rc = p.wait()
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed)", last)}
    emit(result, {"kind": "pytest", "rc": rc, "ok": rc == 0, "summary": last.strip("= "), "failed_tests": failed,
                  **counts})
    return rc


def speedrun(corpus: str, out: str, device: str, result: str, quick: bool = False) -> int:
    """``lmforge speedrun`` on a local corpus with step budgets (a GPU: the medium model, 300 pretraining, 60 SFT
    and 10 RL steps; the CPU: the tiny one, 4 steps, 2 with ``quick``)."""
    size = ["--model-size", "tiny", "--budget", "2steps" if quick else "4steps", "--no-chat", "--vocab-size", "300"] \
        if device == "cpu" else ["--model-size", "medium", "--budget", "300steps", "--sft-budget", "60steps",
                                 "--rl-minutes", "10steps"]
    p = subprocess.run([sys.executable, "-m", "lmforge.cli", "speedrun", "--corpus", corpus, "--out", out, "--device",
                        device, "--no-progress", "--force", *size], cwd=ROOT)
    state = Path(out) / "speedrun.json"
    stages = json.loads(state.read_text())["stages"] if state.exists() else {}
    tr, ev = stages.get("train", {}), stages.get("eval", {})
    emit(result, {"kind": "speedrun", "rc": p.returncode, "ok": p.returncode == 0 and bool(ev),
                  "seconds": {k: v.get("seconds") for k, v in stages.items()}, "steps": tr.get("step"),
                  "tokens_per_s": tr.get("tokens_per_s"), "mfu_datasheet": tr.get("mfu"),
                  "val_loss": ev.get("val_loss"), "val_bpb": ev.get("val_bpb")})
    return p.returncode


def main() -> int:
    argv = sys.argv[1:]
    if "--result" not in argv:
        sys.exit("gpu_run.py: --result FILE is required")
    i = argv.index("--result")
    result, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    if argv[:1] == ["speedrun"]:
        return speedrun(*argv[1:4], result, quick="--quick" in argv[4:])
    if argv[:1] == ["pytest"]:
        return pytest(argv[1:], result)
    sys.exit("gpu_run.py: the first argument is pytest or speedrun")


if __name__ == "__main__":
    sys.exit(main())
