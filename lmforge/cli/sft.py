"""``lmforge sft`` (fine-tune a run on conversations, optionally with LoRA) and ``lmforge lora merge``."""

from __future__ import annotations

import argparse
import os

from lmforge.chat.sft import merge_run, sft
from lmforge.cli import AddArgs, Command, Handler


def _sft_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None, metavar="CONFIG.yaml",
                   help="optional YAML with sections to change (optimizer, training, sft, lora); the base run's "
                        "model and batch settings and the SFT defaults apply otherwise")
    p.add_argument("--base", required=True, metavar="RUN", help="the run to fine-tune (its newest checkpoint)")
    p.add_argument("--checkpoint", default=None, help="a checkpoint of the base run instead of its newest ('best' "
                   "for checkpoints/best.safetensors)")
    p.add_argument("--data", required=True, metavar="FILE.jsonl",
                   help='training conversations, one {"messages": [...]} object per line (OpenAI format)')
    p.add_argument("--val-data", default=None, metavar="FILE.jsonl", help="validation conversations (masked loss)")
    p.add_argument("--run-dir", required=True, metavar="OUT",
                   help="the fine-tuning run directory (resumed if it is this fine-tuning already)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable), e.g. --set training.max_steps=300 "
                        "--set lora.rank=8")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    p.add_argument("--force", action="store_true",
                   help="use --run-dir even if it is a non-empty folder that is not an lmforge run")


def _sft(args: argparse.Namespace) -> int:
    m = sft(args.base, args.data, args.run_dir, val_data=args.val_data, config=args.config,
            overrides=args.overrides, checkpoint=args.checkpoint, force=args.force, progress=not args.no_progress)
    if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 reports
        return 0
    val = f", val loss {m['val_loss']:.4f}" if m.get("val_loss") is not None else ""
    loss = f", train loss {m['loss']:.4f}" if m.get("loss") is not None else ""
    from lmforge.report import write_run_card

    card = write_run_card(args.run_dir)
    print(f"step {m['step']}{loss}{val}; {m['conversations']} conversations ({m['skipped']} skipped as longer "
          f"than the context); run directory {args.run_dir} (card: {card})")
    return 0


def _merge_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", required=True, metavar="DIR", help="a LoRA fine-tuning run (written by lmforge sft)")
    p.add_argument("--out", required=True, metavar="RUN", help="the plain run to write (merged weights)")
    p.add_argument("--force", action="store_true", help="write into --out even if it is not empty")


def _merge(args: argparse.Namespace) -> int:
    out = merge_run(args.run, args.out, force=args.force)
    print(f"merged {args.run} into {out}")
    return 0


COMMANDS: dict[str, tuple[AddArgs, Handler]] = {"sft": (_sft_args, _sft)}
SUBCOMMANDS: list[Command] = [
    ("merge", "fold a LoRA run's adapters into its base: a plain run with the same logits", _merge_args, _merge),
]
