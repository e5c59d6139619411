"""``lmforge train``: pretrain from a YAML config (``lmforge eval`` is in :mod:`lmforge.cli.eval`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from lmforge.cli import AddArgs, Handler
from lmforge.train import load_run_config, train


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML run config with model/optimizer/training/data sections (see examples/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, parsed as YAML (repeatable), e.g. --set training.max_steps=100")
    p.add_argument("--run-dir", default=None,
                   help="run directory (default: runs/<config name>); an existing one is resumed from its newest checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    p.add_argument("--force", action="store_true",
                   help="use --run-dir even if it is a non-empty folder that is not an lmforge run (files of the same "
                        "names as the run's are replaced)")


def _train(args: argparse.Namespace) -> int:
    cfg = load_run_config(args.config, args.overrides)
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / Path(args.config).stem
    m = train(cfg, run_dir, progress=not args.no_progress, force=args.force)
    if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 reports
        return 0
    val = f", val loss {m['val_loss']:.4f} (bpb {m['val_bpb']:.4f})" if m.get("val_bpb") is not None else ""
    loss = f", train loss {m['loss']:.4f}" if m.get("loss") is not None else ""
    from lmforge.report import write_run_card

    card = write_run_card(run_dir)
    print(f"step {m['step']}{loss}{val}; run directory {run_dir} (card: {card})")
    return 0


COMMANDS: dict[str, tuple[AddArgs, Handler]] = {"train": (_train_args, _train)}
