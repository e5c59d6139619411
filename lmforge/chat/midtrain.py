"""Midtraining (``lmforge midtrain``): a base run continued on its own corpus mixed with chat conversations.

nanochat's pipeline is pretrain -> midtrain -> SFT -> RL. Midtraining continues the base model as a language model on
text that already has the chat format, the tool calls and the tasks, so that fine-tuning starts from a model that
has seen them. Here it is :func:`lmforge.chat.sft.sft` (the one renderer, the one loop: checkpoints, metrics,
exact resume) with other settings:

* **Every token trained.** The conversations are rendered by :class:`~lmforge.chat.format.ChatFormat` and their
  mask is dropped: the user's turns, the calculator's output and the format's tokens are trained as well as the
  assistant's, as nanochat's midtraining trains the rendered conversation whole (its data loader keeps the ids and
  drops the mask). Midtraining is language modelling on a mixture; the assistant-only loss is SFT's, which follows.
  ``every_token=False`` (``--targets assistant``) masks as SFT does.
* **A mixture by rows.** ``chat_fraction`` of each micro-batch's rows are conversations (packed whole, padded: a
  padded position trains nothing), the rest blocks of the base's token shards (``sft.pretrain_mix = 1 -
  chat_fraction``, at least one row of each while both are used). With ``data.copy_fraction`` (``--set``), the copy
  mixture writes its segments into those blocks (:mod:`lmforge.data.mixture`).
* **Pretraining's optimizer, nanochat's midtraining schedule.** The base run's optimizer section (its algorithm,
  per-group rates, betas) with the ``wsd`` schedule: 10 warmup steps (the optimizer's moments start afresh), the
  peak rate, then a linear decay over the last fifth of the steps to the base's ``min_lr``.

Everything else (the base's model and batch shape, the chat tokens added to its tokenizer, checks before writing,
``base.json``, the rendered data in ``sft_data/``) is :func:`~lmforge.chat.sft.sft`'s.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from lmforge.chat.sft import sft
from lmforge.config import load_yaml
from lmforge.run import require_run

__all__ = ["midtrain", "midtrain_defaults", "MIDTRAIN_TRAINING", "MIDTRAIN_SCHEDULE"]

MIDTRAIN_TRAINING: dict[str, Any] = {"max_steps": 200, "log_every": 5, "eval_every": 50, "checkpoint_every": 50,
                                     "keep_last": 2}
"""The training settings ``midtrain`` changes from the base run's (any can be overridden with ``--set``)."""
MIDTRAIN_SCHEDULE: dict[str, Any] = {"schedule": "wsd", "warmup_steps": 10, "cooldown_frac": 0.2,
                                     "decay_steps": None}
"""The schedule on top of the base run's optimizer section."""


def midtrain_defaults(base_config: dict[str, Any], chat_fraction: float) -> dict[str, dict[str, Any]]:
    """The config ``midtrain`` puts on top of the base run's model and batch settings: the base's optimizer with
    :data:`MIDTRAIN_SCHEDULE`, :data:`MIDTRAIN_TRAINING`, and the mixture (``sft.pretrain_mix``)."""
    check_chat_fraction(chat_fraction)
    optimizer = {**(base_config.get("optimizer") or {}), **MIDTRAIN_SCHEDULE}
    return {"optimizer": optimizer, "training": dict(MIDTRAIN_TRAINING),
            "sft": {"pretrain_mix": round(1.0 - float(chat_fraction), 6)}}


def check_chat_fraction(chat_fraction: Any) -> None:
    """``ValueError`` unless ``chat_fraction`` is a share of rows in (0, 1]."""
    if isinstance(chat_fraction, bool) or not isinstance(chat_fraction, (int, float)) or not 0 < chat_fraction <= 1:
        raise ValueError(f"the chat fraction must be in (0, 1] (the share of each batch's rows given to "
                         f"conversations; 1 = conversations only), got {chat_fraction!r}")


def midtrain(base: str | os.PathLike, data: str | os.PathLike, run_dir: str | os.PathLike, *,
             chat_fraction: float = 0.5, val_data: str | os.PathLike | None = None,
             config: str | os.PathLike | None = None, overrides: Sequence[str] = (),
             checkpoint: str | os.PathLike | None = None, every_token: bool = True, force: bool = False,
             progress: bool = True) -> dict[str, Any]:
    """Midtrain the base run ``base`` on its token shards mixed with the conversations of ``data`` (JSONL of
    ``{"messages": [...]}``) into ``run_dir`` (resumed if it is this midtraining already); see the module docstring.

    Returns :func:`lmforge.chat.sft.sft`'s metrics. ``ValueError`` for every bad input, before anything is written.
    """
    base_config = load_yaml(require_run(base) / "config.yaml")  # sft opens and checks the base and its checkpoint
    return sft(base, data, run_dir, val_data=val_data, config=config, overrides=overrides, checkpoint=checkpoint,
               force=force, progress=progress, defaults=midtrain_defaults(base_config, chat_fraction),
               every_token=every_token)
