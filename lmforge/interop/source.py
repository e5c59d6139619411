"""What every export reads: a run's model config, weights and tokenizer, opened once and checked.

The run is opened through :func:`lmforge.run.open_run` (the one place that finds and verifies a run's
checkpoint), and its tensors are checked against the run's architecture with the checkpoint API
(:func:`lmforge.checkpoint.check_state_dict_fits`, the check ``apply_checkpoint`` makes) on a ``TransformerLM``
built on the meta device: the model's shapes without drawing ~millions of random numbers that the checkpoint
would overwrite anyway (``TransformerLM``'s init costs seconds for the demo model, more than the export).
Anything that later changes how a run becomes weights (a LoRA run merged into its base: ``W + (alpha/r)·B·A``
per adapted matrix) belongs in :func:`open_export_source`, right after that check, or in ``open_run`` itself.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING

from lmforge.checkpoint import check_state_dict_fits
from lmforge.config import from_dict
from lmforge.interop.hf import check_llama_expressible
from lmforge.model import ModelConfig, TransformerLM
from lmforge.run import Run, open_run
from lmforge.tokenizer import Tokenizer

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["ExportSource", "architecture", "check_output_dir", "open_export_source"]


@dataclasses.dataclass
class ExportSource:
    """A run ready to export: its ``ModelConfig``, float32 weights (our names) and tokenizer."""

    cfg: ModelConfig
    state: dict[str, "torch.Tensor"]
    """``TransformerLM.state_dict()`` in float32 (with tied embeddings, ``lm_head.weight`` is the embedding)."""
    tokenizer: Tokenizer
    run: Run
    step: int


def open_export_source(run_dir: str | os.PathLike, checkpoint: str | os.PathLike | None = None) -> ExportSource:
    """Open ``run_dir`` (``checkpoint``: a file, ``"best"`` or None for the newest valid one) for export.

    ``ValueError`` for a missing/foreign run or checkpoint (from :func:`~lmforge.run.open_run`), a model option
    Llama cannot express, or a tokenizer with more ids than the model's embedding.
    """
    run = open_run(run_dir, checkpoint)
    cfg = from_dict(ModelConfig, run.config.get("model"), path="model")
    check_llama_expressible(cfg)
    check_state_dict_fits(run.checkpoint.model, architecture(cfg).state_dict())
    tokenizer = Tokenizer.load(run.tokenizer_path)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"{run.tokenizer_path} has {tokenizer.vocab_size} tokens but the model only "
                         f"{cfg.vocab_size} embedding rows; the run's tokenizer and checkpoint do not belong together")
    state = {name: t.detach().float().contiguous() for name, t in run.checkpoint.model.items()}
    if cfg.tie_embeddings:  # one tensor, as in the model (the checkpoint restores the alias as the same tensor)
        state["lm_head.weight"] = state["token_embeddings.weight"]
    return ExportSource(cfg=cfg, state=state, tokenizer=tokenizer, run=run, step=run.checkpoint.iteration)


def architecture(cfg: ModelConfig) -> TransformerLM:
    """``TransformerLM(cfg)`` on the meta device: names and shapes of its tensors, no memory, no random init."""
    return TransformerLM(cfg, device="meta")


def check_output_dir(path: str | os.PathLike, force: bool, flag: str = "--out") -> Path:
    """``path`` as a Path after checking an export/import may write there (nothing is created here).

    Allowed: a path that does not exist or an empty directory; an existing non-empty directory only with
    ``force`` (lmforge's files are then replaced, others left alone). A file is always refused.
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{p} is an existing file; give a directory path to {flag}")
    if p.is_dir() and any(p.iterdir()) and not force:
        raise ValueError(f"{p} already exists and is not empty; choose a new {flag} directory, or pass --force "
                         "(CLI) / force=True to replace the files lmforge writes there")
    return p
