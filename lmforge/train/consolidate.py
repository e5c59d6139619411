"""``consolidate``: a run's sharded (DCP) checkpoint as the usual single-file safetensors checkpoint.

The file holds the full model, the optimizer state in single-process form and the training state, exactly as a
``checkpoint_format: file`` run writes it, so every command that reads runs (``eval``, ``generate``, exports)
reads it, and a single-process ``lmforge train`` resumes from it. Runs in one plain process: DCP reshards the
ranks' pieces into the whole tensors.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from lmforge.checkpoint import CheckpointManager, save_checkpoint
from lmforge.model import TransformerLM
from lmforge.run import require_run
from lmforge.train.config import load_run_config
from lmforge.train.dcp import load_dcp
from lmforge.train.loop import _build_optimizer  # the loop's own builder: the same groups

__all__ = ["consolidate"]


def consolidate(run_dir: str | os.PathLike, out: str | os.PathLike | None = None, step: int | None = None,
                force: bool = False) -> Path:
    """Write the sharded checkpoint of ``step`` (default: the newest) of ``run_dir`` as one safetensors file.

    ``out`` defaults to ``checkpoints/step_{N:08d}.safetensors`` in the run (the name ``eval``/``generate`` look
    for). An existing ``out`` is replaced only with ``force``. Returns the path written.
    """
    if dist.is_available() and dist.is_initialized():
        raise ValueError("consolidate runs in one plain process; run `lmforge checkpoint consolidate` without torchrun")
    run = require_run(run_dir)
    ckpts = CheckpointManager(run)
    sharded = dict(ckpts.dcp_steps())
    if not sharded:
        raise ValueError(f"{ckpts.dir} holds no sharded checkpoint (step_*.dcp); train with "
                         "training.checkpoint_format=dcp, or use its .safetensors checkpoints directly")
    if step is None:
        step = max(sharded)
    if step not in sharded:
        raise ValueError(f"{run} has no sharded checkpoint of step {step}; it has steps "
                         f"{', '.join(map(str, sorted(sharded)))}")
    dest = Path(out) if out is not None else ckpts.path_for(step)
    if dest.exists() and not force:
        raise ValueError(f"{dest} already exists; pass --force to replace it, or --out another file")
    cfg = load_run_config(run / "config.yaml")
    model = TransformerLM.for_loading(cfg.model)  # the shards fill every tensor
    optimizer = _build_optimizer(model, cfg.optimizer)
    iteration, extra = load_dcp(sharded[step], model, optimizer)
    save_checkpoint(model, optimizer, iteration, dest, extra)
    return dest
