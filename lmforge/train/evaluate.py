"""Evaluation of a model on fixed validation batches: loss, perplexity, bits per byte.

``evaluate`` is what the training loop calls every ``eval_every`` steps (summed over ranks) and when it judges
``training.target_val_bpb``; ``validation_batches`` builds the fixed batches both the loop's target check and
``evaluate_run`` (a finished run's checkpoint: ``lmforge eval``, the speedrun's final figure) score.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

import torch

from lmforge.checkpoint import apply_checkpoint
from lmforge.common import resolve_device
from lmforge.data import TokenDataset, val_batches
from lmforge.data.conversations import IGNORE_INDEX, ConversationDataset, conversation_val_batches
from lmforge.model import TransformerLM
from lmforge.run import open_run
from lmforge.train.config import load_run_config
from lmforge.train.distributed import all_reduce_sum

logger = logging.getLogger("lmforge")

__all__ = ["Evaluation", "evaluate", "evaluate_run", "validation_batches"]


@dataclasses.dataclass
class Evaluation:
    """Mean loss (nats per target token), perplexity, and bits per byte (None if the split's bytes are unknown)."""

    loss: float
    ppl: float
    bpb: float | None


def evaluate(model: Any, batches: list, bytes_per_token: float, dtype: str, device: Any,
             ignore_index: int | None = None) -> Evaluation:
    """Mean loss over the fixed validation batches (token-weighted, summed over ranks), perplexity, bits/byte.

    ``ignore_index``: targets of this id (masked conversation tokens) count for nothing, in the loss and the count.
    """
    was_training = model.training
    model.eval()
    loss_sum, count = 0.0, 0
    with torch.no_grad():
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
                loss_sum += float(model(x, targets=y, ignore_index=ignore_index, reduction="sum"))
            count += y.numel() if ignore_index is None else int((y != ignore_index).sum())
    model.train(was_training)
    loss_sum, count = all_reduce_sum([loss_sum, float(count)], device)
    loss = loss_sum / max(count, 1.0)
    bpb = loss / math.log(2) / bytes_per_token if bytes_per_token > 0 else None
    return Evaluation(loss=loss, ppl=math.exp(min(loss, 700.0)), bpb=bpb)


def validation_batches(ds: TokenDataset | ConversationDataset, batch_size: int, context_length: int,
                       max_batches: int | None) -> tuple[list, int | None, int]:
    """The split's fixed validation batches (its first blocks in order; up to ``max_batches``, ``None`` = every
    whole batch the split holds), the target id they ignore (conversations: :data:`IGNORE_INDEX`, else None) and
    the number of targets they score."""
    n = max_batches if max_batches is not None else max(1, len(ds))  # tokens or conversations: >= its batches
    if isinstance(ds, ConversationDataset):  # rendered conversations: masked targets
        batches, ignore = conversation_val_batches(ds, batch_size, context_length, n), IGNORE_INDEX
    else:
        batches, ignore = val_batches(ds, batch_size, context_length, n), None
    return batches, ignore, sum(int((y != IGNORE_INDEX).sum()) for _, y in batches)


def evaluate_run(run_dir: str | Path, checkpoint: str | Path | None = None, split: str | None = None,
                 max_batches: int | None = None, device: str = "auto") -> dict[str, Any]:
    """Loss, perplexity and bits per byte of a run's checkpoint on a split of its data.

    ``checkpoint``: a file, ``"best"`` (``checkpoints/best.safetensors``) or None for the newest valid
    one; ``split`` defaults to the run's ``data.val_split``; ``max_batches`` to ``training.eval_batches``.
    """
    if max_batches is not None and (isinstance(max_batches, bool) or not isinstance(max_batches, int)
                                    or max_batches < 1):
        raise ValueError(f"the number of eval batches must be a positive integer, got {max_batches!r} "
                         "(leave it unset for the run's training.eval_batches)")
    run = open_run(run_dir, checkpoint)
    cfg = load_run_config(base=run.config)
    if cfg.data.kind == "prompts":
        raise ValueError(f"{run_dir} is an RL run: its data are prompts with answers, not text to take a loss on; "
                         "score it with --task FILE.jsonl (e.g. the chat tasks), or read its rl.json")
    split = split or cfg.data.val_split or cfg.data.train_split
    path, ck = run.checkpoint_path, run.checkpoint
    dev = resolve_device(device)
    model = TransformerLM.for_loading(cfg.model, device=dev)
    step = apply_checkpoint(ck, model)
    eval_b, n = cfg.training.eval_batch_size or cfg.training.batch_size, max_batches or cfg.training.eval_batches
    ds: Any = (ConversationDataset(cfg.data.dir, split) if cfg.data.kind == "conversations"  # a fine-tuning run
               else TokenDataset(cfg.data.dir, split))
    batches, ignore, tokens = validation_batches(ds, eval_b, cfg.context_length, n)
    with torch.inference_mode():
        ev = evaluate(model, batches, ds.bytes_per_token, cfg.training.dtype, dev, ignore_index=ignore)
    logger.info("%s (step %d) on %s/%s: loss %.4f", path, step, cfg.data.dir, split, ev.loss)
    return {"checkpoint": str(path), "step": step, "split": split, "loss": ev.loss, "ppl": ev.ppl, "bpb": ev.bpb,
            "tokens": tokens}
