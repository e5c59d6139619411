"""The run's report files without the optional plotting stack: a GPU image installed with ``--no-deps`` may lack
``matplotlib`` and ``platformdirs``; training must still import and run (no ``loss.png``, a warning)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_BARE = """
import sys
sys.modules["matplotlib"] = None  # import matplotlib -> ImportError, as on a machine without it
sys.modules["platformdirs"] = None
import logging, json
logging.basicConfig(level=logging.WARNING)
import lmforge.train  # loads lmforge.corpus.datasets
from lmforge.corpus.datasets import resolve_cache_dir
from lmforge.train.metrics import MetricsLog, plot_losses
out = sys.argv[1]
log = MetricsLog(out)
log.log({"step": 1, "loss": 2.0})
log.plot()
log.plot()
print(json.dumps({"cache": str(resolve_cache_dir()), "drawn": plot_losses(log.records, out + "/x.png")}))
"""


def test_training_imports_and_plots_nothing_without_matplotlib_or_platformdirs(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    r = subprocess.run([sys.executable, "-c", _BARE, str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"cache": str(tmp_path / "xdg" / "lmforge"), "drawn": False}
    assert not (tmp_path / "loss.png").exists() and (tmp_path / "metrics.jsonl").exists()
    assert r.stderr.count("matplotlib is not installed") == 1, r.stderr  # warned once, not per plot



def test_step_seconds_reads_each_interval_from_its_own_tokens_and_rate() -> None:
    """Seconds per step come from the tokens a logged interval ran over its rate, not from batch x context (RL's
    padded rollouts run far fewer): evaluation records are skipped, an interval of several steps is divided."""
    from lmforge.train.metrics import step_seconds

    records = [{"step": 1, "loss": 2.0, "tokens": 300, "tokens_per_s": 150.0},
               {"step": 1, "val_loss": 2.1},
               {"step": 4, "loss": 1.5, "tokens": 900, "tokens_per_s": 200.0},  # 600 tokens in 3 steps at 200/s
               {"step": 5, "loss": 1.4, "tokens": 1000, "tokens_per_s": 0.0}]  # no rate: skipped
    assert step_seconds(records) == [2.0, 1.0]
    assert step_seconds([]) == []
