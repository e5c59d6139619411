"""What a training run reports: ``metrics.jsonl``, the ``loss.png`` curve, optional Weights & Biases.

MFU divides by the device's peak FLOP/s from :mod:`lmforge.hardware`.

Only the main process writes; every method is a no-op on other ranks (``enabled=False``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any

from lmforge.common import atomic_open, atomic_write_text

logger = logging.getLogger("lmforge")
_warned_no_plot: list[bool] = []  # the missing-matplotlib warning is logged once per process


def step_seconds(records: list[dict[str, Any]]) -> list[float]:
    """Seconds per optimizer step of each logged training record of ``metrics.jsonl``, in order: the tokens run
    since the previous logged step over the record's tokens/s (its interval's own rate), per step of the interval.
    (A step's tokens are what it ran: for RL's padded rollouts far fewer than batch x context.)"""
    out, prev_step, prev_tokens = [], 0, 0
    for r in records:
        if "loss" not in r or not r.get("tokens_per_s"):
            continue
        steps = max(1, int(r["step"]) - prev_step)
        out.append((float(r["tokens"]) - prev_tokens) / float(r["tokens_per_s"]) / steps)
        prev_step, prev_tokens = int(r["step"]), float(r["tokens"])
    return out


def plot_losses(records: list[dict[str, Any]], path: str | Path) -> bool:
    """Write a PNG of train loss (and val loss, if any) against step, atomically; False (and no file) when
    matplotlib is not installed: the plot is the one thing training can do without."""
    try:
        import matplotlib  # here, not at the top: ~0.2 s of import (measured) that only plotting needs
    except ImportError:
        if not _warned_no_plot:
            _warned_no_plot.append(True)
            logger.warning("matplotlib is not installed: no %s (pip install matplotlib)", Path(path).name)
        return False

    matplotlib.use("Agg")  # no display needed; set here, not at import, so we never change a user's backend early
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="val", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png")
    plt.close(fig)
    return True


def require_wandb() -> Any:
    """The ``wandb`` module, imported on demand (``ValueError`` saying how to fix it when missing)."""
    try:
        import wandb  # optional dependency
    except ImportError as e:
        raise ValueError("training.wandb is true but the wandb package is not installed; "
                         "`pip install wandb` or set training.wandb=false") from e
    return wandb


class MetricsLog:
    """Appends one JSON object per event to ``metrics.jsonl``, keeps them in memory for the plot, mirrors to wandb."""

    def __init__(self, run_dir: str | Path, enabled: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.plot_path = self.run_dir / "loss.png"
        self.enabled = enabled
        self.records: list[dict[str, Any]] = []
        self._wandb: Any = None

    def rewind(self, step: int) -> None:
        """Keep only the events up to ``step`` (those a resumed run will not repeat), rewriting the file.

        A run killed after its last checkpoint logged steps that the resumed run will log again; a
        half-written last line (killed mid-write) is dropped too.
        """
        if not self.enabled or not self.path.exists():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and rec.get("step", math.inf) <= step:
                kept.append(rec)
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self.records = kept

    def log(self, record: dict[str, Any]) -> None:
        """Append ``record`` (must hold ``step``) to the file and to wandb if enabled."""
        if not self.enabled:
            return
        self.records.append(record)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=record["step"])

    def plot(self) -> None:
        """Redraw ``loss.png`` from every event so far."""
        if self.enabled and self.records:
            plot_losses(self.records, self.plot_path)

    def start_wandb(self, project: str, mode: str, config: dict[str, Any]) -> None:
        """Start (or resume) a wandb run for this run directory; ``mode="offline"`` needs no account."""
        if not self.enabled:
            return
        wandb = require_wandb()
        run_id = hashlib.sha256(str(self.run_dir.resolve()).encode()).hexdigest()[:16]  # same dir -> same run
        self._wandb = wandb.init(project=project, name=self.run_dir.name, id=run_id, resume="allow",
                                 dir=str(self.run_dir), mode=mode, config=config)
        logger.info("wandb run %s (mode %s)", run_id, mode)

    def close(self) -> None:
        """Finish the wandb run, if any."""
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
