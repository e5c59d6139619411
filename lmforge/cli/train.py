"""``lmforge train`` (pretrain from a YAML config) and ``lmforge eval`` (a run's checkpoint on its validation data)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from lmforge.cli import AddArgs, Handler, positive_int
from lmforge.train import evaluate_run, load_run_config, train


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
    print(f"step {m['step']}{loss}{val}; run directory {run_dir}")
    return 0


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run directory written by lmforge train")
    p.add_argument("--checkpoint", default=None, help="checkpoint file, or 'best' (default: the newest valid one)")
    p.add_argument("--split", default=None, help="data split to evaluate on (default: the run's validation split)")
    p.add_argument("--batches", type=positive_int, default=None, help="number of batches (default: training.eval_batches)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default auto)")


def _eval(args: argparse.Namespace) -> int:
    m = evaluate_run(args.run_dir, args.checkpoint, args.split, args.batches, args.device)
    bpb = f", bits/byte {m['bpb']:.4f}" if m["bpb"] is not None else ""
    print(f"{m['checkpoint']} (step {m['step']}) on {m['split']} ({m['tokens']:,} tokens): loss {m['loss']:.4f}, "
          f"perplexity {m['ppl']:.2f}{bpb}")
    return 0


COMMANDS: dict[str, tuple[AddArgs, Handler]] = {"train": (_train_args, _train), "eval": (_eval_args, _eval)}
