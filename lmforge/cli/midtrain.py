"""``lmforge midtrain``: continue a base run on its corpus mixed with chat conversations (see
:mod:`lmforge.chat.midtrain`)."""

from __future__ import annotations

import argparse
import os

from lmforge.chat.midtrain import midtrain
from lmforge.cli import AddArgs, Handler


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _midtrain_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None, metavar="CONFIG.yaml",
                   help="optional YAML with sections to change (optimizer, training, data, sft); the base run's "
                        "model, batch and optimizer settings and the midtraining defaults apply otherwise")
    p.add_argument("--base", required=True, metavar="RUN",
                   help="the pretrained run to continue (its newest checkpoint)")
    p.add_argument("--checkpoint", default=None, help="a checkpoint of the base run instead of its newest ('best' "
                   "for checkpoints/best.safetensors)")
    p.add_argument("--data", required=True, metavar="FILE.jsonl",
                   help='chat conversations to mix in, one {"messages": [...]} object per line (e.g. the built-in '
                        "chat tasks of `lmforge data get chat-tasks`)")
    p.add_argument("--val-data", default=None, metavar="FILE.jsonl", help="validation conversations")
    p.add_argument("--run-dir", required=True, metavar="OUT",
                   help="the midtraining run directory (resumed if it is this midtraining already)")
    p.add_argument("--chat-fraction", type=_fraction, default=0.5, metavar="F",
                   help="share of each batch's rows given to conversations, in (0, 1]; the rest are blocks of the "
                        "base run's token shards (default 0.5; 1 = conversations only)")
    p.add_argument("--targets", choices=("all", "assistant"), default="all",
                   help="the conversations' tokens trained: all (default, as nanochat's midtraining) or the "
                        "assistant's only (as SFT)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable), e.g. --set training.max_steps=300 "
                        "--set data.copy_fraction=0.1")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    p.add_argument("--force", action="store_true",
                   help="use --run-dir even if it is a non-empty folder that is not an lmforge run")


def _midtrain(args: argparse.Namespace) -> int:
    m = midtrain(args.base, args.data, args.run_dir, chat_fraction=args.chat_fraction, val_data=args.val_data,
                 config=args.config, overrides=args.overrides, checkpoint=args.checkpoint,
                 every_token=args.targets == "all", force=args.force, progress=not args.no_progress)
    if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 reports
        return 0
    from lmforge.report import write_run_card

    card = write_run_card(args.run_dir)
    loss = f", train loss {m['loss']:.4f}" if m.get("loss") is not None else ""
    val = f", val loss {m['val_loss']:.4f}" if m.get("val_loss") is not None else ""
    print(f"step {m['step']}{loss}{val}; {m['conversations']} conversations mixed in ({m['skipped']} skipped as "
          f"longer than the context); run directory {args.run_dir} (card: {card})")
    return 0


COMMANDS: dict[str, tuple[AddArgs, Handler]] = {"midtrain": (_midtrain_args, _midtrain)}
