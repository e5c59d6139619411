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

