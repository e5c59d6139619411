"""``lmforge checkpoint consolidate``: a run's sharded (DCP) checkpoint as one safetensors file."""

from __future__ import annotations

import argparse

from lmforge.cli import Command
from lmforge.train.consolidate import consolidate


def _consolidate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run directory trained with training.checkpoint_format=dcp")
    p.add_argument("--step", type=int, default=None, help="which step's sharded checkpoint (default: the newest)")
    p.add_argument("--out", default=None,
                   help="file to write (default: RUN/checkpoints/step_N.safetensors, which eval and generate read)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")


def _consolidate(args: argparse.Namespace) -> int:
    path = consolidate(args.run_dir, args.out, args.step, args.force)
    print(f"wrote {path}")
    return 0


SUBCOMMANDS: list[Command] = [
    ("consolidate", "write a sharded (DCP) checkpoint as the usual single-file checkpoint", _consolidate_args,
     _consolidate),
]
