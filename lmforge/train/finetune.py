"""Fine-tuning inside the one training loop: the model from a base run, masked conversation data, the global
target count, and what a fine-tuning checkpoint holds.

:func:`train <lmforge.train.loop.train>` calls these where pretraining and fine-tuning differ:

* ``_build``: :func:`build_model` starts from the base run's checkpoint (``cfg.sft``; a LoRA base is read
  through :func:`lmforge.run.open_run`, its adapters folded in, as every reader sees it), grows the embedding and
  head to ``model.vocab_size`` (new rows = the mean rows, :meth:`TransformerLM.resize_vocab`) and, with a
  ``lora`` section, wraps the targeted projections with adapters and freezes everything else.
* ``_check``: :func:`conversation_data` opens the rendered conversations (``data.kind: conversations``) and
  makes the packed, masked loader (mixed with the base's token shards for ``sft.pretrain_mix``, the copy mixture
  of ``data.copy_fraction`` written into those blocks).
* ``_train_step``: :func:`global_target_count` is the number of trained targets of the whole step (every
  micro-batch, every rank), the loss's denominator, so accumulation and data parallelism equal one big batch.
* ``_snapshot``/``_resume``: :func:`trained_state` is what a checkpoint holds: the whole model, or for a LoRA
  run only the adapters (a few MB; the base is never copied), and :func:`load_trained_state` puts it back.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from lmforge.checkpoint import apply_checkpoint
from lmforge.common import sha256_file
from lmforge.data import BlockLoader, TokenDataset, copy_mixture
from lmforge.data.conversations import (IGNORE_INDEX, ConversationDataset, ConversationLoader, MixedLoader,
                                        conversation_val_batches)
from lmforge.model import TransformerLM
from lmforge.model.lora import apply_lora, load_lora_state_dict, lora_state_dict
from lmforge.run import open_run
from lmforge.train.distributed import all_reduce_sum

logger = logging.getLogger("lmforge")

__all__ = ["build_model", "check_base_checkpoint", "conversation_data", "global_target_count", "loss_scale",
           "masked", "trained_state", "load_trained_state", "IGNORE_INDEX"]


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------
def check_base_checkpoint(path: str | Path, sha256: str) -> Path:
    """``path`` after checking it exists and is the file whose sha256 a fine-tuning run recorded."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"the base checkpoint {p} is gone; restore it (a fine-tuning run starts from it, and a "
                         "LoRA run's adapters need it to load)")
    if sha256 and sha256_file(p) != sha256:
        raise ValueError(f"the base checkpoint {p} changed since this run was made (sha256 differs): the adapters "
                         "or the run's start belong to another base; restore that file or fine-tune again")
    return p


def build_model(cfg: Any, device: Any, resuming: bool) -> Any:
    """The model a run trains: fresh (pretraining), or the base run's weights grown to ``model.vocab_size``.

    ``resuming``: a full fine-tuning run with a checkpoint does not read the base again (its checkpoint holds
    every weight); a LoRA run always does (its checkpoints hold only adapters).
    """
    sft, lora = cfg.sft, cfg.lora
    if sft is None or (resuming and lora is None):
        return TransformerLM(cfg.model).to(device)
    path = check_base_checkpoint(sft.base_checkpoint, sft.base_sha256)
    model = TransformerLM(dataclasses.replace(cfg.model, vocab_size=sft.base_vocab_size))
    apply_checkpoint(open_run(sft.base_run, path).checkpoint, model)  # a LoRA base: its adapters folded in
    model.resize_vocab(cfg.model.vocab_size)
    if lora is not None:
        names = apply_lora(model, lora)
        logger.info("LoRA rank %d on %d projections; trainable %s of %s parameters", lora.rank, len(names),
                    f"{sum(p.numel() for p in model.parameters() if p.requires_grad):,}",
                    f"{sum(p.numel() for p in model.parameters()):,}")
    return model.to(device)


class _StateView:
    """Something whose ``state_dict()`` is a given dict (what :class:`CheckpointManager` saves)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state


def trained_state(cfg: Any, model: Any) -> Any:
    """What a checkpoint saves as the model: ``model`` itself, or only its adapters for a LoRA run."""
    if cfg.lora is None:
        return model
    return _StateView(lora_state_dict(model))


def load_trained_state(cfg: Any, ckpt: Any, model: Any, optimizer: Any) -> int:
    """Put a checkpoint written from :func:`trained_state` back into ``model`` and ``optimizer``; its step."""
    if cfg.lora is None:
        return apply_checkpoint(ckpt, model, optimizer)
    load_lora_state_dict(model, ckpt.model)
    if optimizer is not None:
        optimizer.load_state_dict(ckpt.optimizer)
    return ckpt.iteration


# --------------------------------------------------------------------------------------------------
# Data and the loss's denominator
# --------------------------------------------------------------------------------------------------
def conversation_data(cfg: Any, tokenizer: Any, info: Any, micro_batch: int) -> tuple[Any, Any, list, Any]:
    """``(train split, val split or None, fixed val batches, loader)`` for ``data.kind: conversations``.

    ``micro_batch`` rows per micro-batch (the loop's batch plan). The loader mixes in the base's pretraining blocks
    when ``sft.pretrain_mix > 0``: ``round(mix * micro_batch)`` rows of every micro-batch (at least one), the rest
    conversations; ``data.copy_fraction`` writes its copy segments into those blocks.
    """
    dc, tc, T = cfg.data, cfg.training, cfg.context_length
    train_ds = ConversationDataset(dc.dir, dc.train_split)
    val_ds = ConversationDataset(dc.dir, dc.val_split) if dc.val_split and \
        dc.val_split in train_ds.manifest["splits"] else None
    V = cfg.model.vocab_size
    for ds in (train_ds, val_ds):
        if ds is None:
            continue
        ds.check_tokenizer(tokenizer)
        if ds.max_token_id >= V:
            raise ValueError(f"{ds.dir} split {ds.split!r} holds token id {ds.max_token_id}, beyond model.vocab_size="
                             f"{V}; render the conversations again with the run's tokenizer")
    n_tok = cfg.sft.pretrain_rows(micro_batch) if cfg.sft is not None else 0
    conv = ConversationLoader(train_ds, micro_batch - n_tok, T, seed=tc.seed, rank=info.rank,
                              world_size=info.world_size)
    loader: Any = conv
    if n_tok:
        shards = TokenDataset(cfg.sft.pretrain_dir, "train")
        if shards.max_token_id >= V:
            raise ValueError(f"the pretraining shards {shards.dir} hold token id {shards.max_token_id}, beyond "
                             f"model.vocab_size={V}")
        loader = MixedLoader(conv, BlockLoader(shards, n_tok, T, seed=tc.seed, rank=info.rank,
                                               world_size=info.world_size, mixture=copy_mixture(dc, tokenizer)))
        logger.info("pretraining mix: %d of %d rows per micro-batch from %s", n_tok, micro_batch, shards.dir)
    val_set = (conversation_val_batches(val_ds, tc.eval_batch_size or tc.batch_size, T, tc.eval_batches)
               if val_ds is not None else [])
    return train_ds, val_ds, val_set, loader


def global_target_count(batches: list, device: Any) -> float:
    """Trained (not ignored) targets of all ``(x, y[, weights])`` micro-batches, summed over every data-parallel
    rank."""
    local = sum(int((b[1] != IGNORE_INDEX).sum()) for b in batches)  # b: (x, y) or (x, y, weights)
    return all_reduce_sum([float(local)], device)[0]


def loss_scale(count: float, world_size: int) -> float:
    """The divisor of each rank's summed micro-batch loss: DDP/FSDP average gradients over ranks, so dividing
    by ``count / world_size`` makes the update the gradient of (sum over all ranks) / ``count``."""
    return max(count, 1.0) / world_size


def masked(loader: Any) -> bool:
    """Whether ``loader``'s targets may hold :data:`IGNORE_INDEX` (the loss must be told): conversations, or a
    loader that says so (``masked = True``, RL's rollouts)."""
    return isinstance(loader, (ConversationLoader, MixedLoader)) or bool(getattr(loader, "masked", False))

