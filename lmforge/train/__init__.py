"""Stage 4, batches -> checkpoints: the run config, the training loop with exact resume, optimizers, evaluation.

``config`` holds ``RunConfig``; ``loop`` ``train(cfg, run_dir)``; ``evaluate`` loss/perplexity/bits per byte; ``optim`` the optimizers (SGD, AdamW) and the
learning-rate schedule; ``distributed`` DDP/FSDP and activation checkpointing from the ``torchrun`` environment;
``batching`` the global batch split into micro-batches; ``dcp`` sharded checkpoints and ``consolidate`` their
single-file form; ``metrics`` the ``metrics.jsonl`` log, the loss plot and MFU.
"""

from lmforge.train.config import DataConfig, OptimConfig, RunConfig, TrainingConfig, load_run_config
from lmforge.train.evaluate import evaluate_run
from lmforge.train.loop import NonFiniteLossError, train
from lmforge.train.optim import SGD, AdamW, Muon, clip_grad_norm, cosine_lr

__all__ = ["OptimConfig", "DataConfig", "TrainingConfig", "RunConfig", "load_run_config", "train", "evaluate_run",
           "NonFiniteLossError", "SGD", "AdamW", "Muon", "cosine_lr", "clip_grad_norm"]
