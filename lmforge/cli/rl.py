"""``lmforge rl``: reinforcement learning from verifiable rewards on a chat run (resumes automatically)."""

from __future__ import annotations

import argparse
import os

from lmforge.cli import AddArgs, Handler
from lmforge.rl import rl


def _rl_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None, metavar="CONFIG.yaml",
                   help="optional YAML with sections to change (rl, optimizer, training, lora); the base run's model "
                        "and batch settings and the RL defaults apply otherwise")
    p.add_argument("--base", required=True, metavar="RUN", help="the chat run to start from (an `lmforge sft` run)")
    p.add_argument("--checkpoint", default=None, help="a checkpoint of the base run instead of its newest")
    p.add_argument("--data", required=True, metavar="FILE.jsonl",
                   help='prompts with exact answers: chat items, one {"messages": [...]} per line ending with the '
                        "assistant's answer (e.g. `lmforge data get chat-tasks`)")
    p.add_argument("--val-data", default=None, metavar="FILE.jsonl",
                   help="validation prompts: greedy exact match, pass@1 and pass@k before and after training")
    p.add_argument("--run-dir", required=True, metavar="OUT",
                   help="the RL run directory (resumed if it is this RL run already)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable), e.g. --set rl.samples_per_prompt=16 "
                        "--set rl.reward=format --set training.max_steps=100")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    p.add_argument("--force", action="store_true",
                   help="use --run-dir even if it is a non-empty folder that is not an lmforge run")


def _pct(r: dict | None, key: str) -> str:
    if not r:
        return "n/a"
    v = r[key]
    return f"{100 * v['value']:.1f}% [{100 * v['ci'][0]:.1f}, {100 * v['ci'][1]:.1f}]"


def _rl(args: argparse.Namespace) -> int:
    m = rl(args.base, args.data, args.run_dir, val_data=args.val_data, config=args.config, overrides=args.overrides,
           checkpoint=args.checkpoint, force=args.force, progress=not args.no_progress)
    if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 reports
        return 0
    from lmforge.report import write_run_card

    card = write_run_card(args.run_dir)
    line = f"step {m['step']}; {m['prompts']} prompts ({m['skipped']} skipped as too long)"
    if m.get("after"):
        line += (f"; greedy exact match {_pct(m['before'], 'greedy_exact_match')} -> "
                 f"{_pct(m['after'], 'greedy_exact_match')}, pass@1 {_pct(m['before'], 'pass_at_1')} -> "
                 f"{_pct(m['after'], 'pass_at_1')}")
    print(f"{line}; run directory {args.run_dir} (card: {card})")
    return 0


COMMANDS: dict[str, tuple[AddArgs, Handler]] = {"rl": (_rl_args, _rl)}
