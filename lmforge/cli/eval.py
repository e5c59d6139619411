"""``lmforge eval`` (a run's checkpoint: validation loss, or tasks) and ``lmforge report`` (run cards)."""

from __future__ import annotations

import argparse
import json

from lmforge.cli import AddArgs, Handler, positive_int


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run directory written by lmforge train")
    p.add_argument("--task", dest="tasks", action="append", default=[], metavar="NAME|FILE",
                   help="score a task instead of the validation loss (repeatable): a JSONL task file (choice, cloze, "
                        "text or chat items; schemas in docs/DESIGN.md), a .txt file or a shard directory "
                        "(perplexity), shakespeare-nextline, shakespeare-cloze, or a benchmark fetched by "
                        "`lmforge data get evals` (arc_easy, arc_challenge, hellaswag, piqa, winogrande, openbookqa, "
                        "boolq, sciq, csqa, socialiqa, lambada, mmlu)")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N", help="score only the first N items of each task")
    p.add_argument("--batch-size", type=positive_int, default=16, metavar="N",
                   help="requests (choices, windows or prompts) per forward pass (default 16); each chat reply "
                        "keeps its own token budget, whatever shares its batch")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--checkpoint", default=None, help="checkpoint file, or 'best' (default: the newest valid one)")
    p.add_argument("--split", default=None, help="data split to evaluate on (default: the run's validation split)")
    p.add_argument("--batches", type=positive_int, default=None, help="number of batches (default: training.eval_batches)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default auto)")
    p.add_argument("--no-card", action="store_true", help="do not rewrite the run card (report.md/report.json)")


def _eval(args: argparse.Namespace) -> int:
    from lmforge.report import write_run_card

    if args.tasks:
        if args.split or args.batches:
            raise ValueError("--split and --batches apply to the validation loss; drop them with --task "
                             "(use --limit to score fewer items)")
        from lmforge.evals import evaluate_tasks, format_result

        results = evaluate_tasks(args.run_dir, args.tasks, args.checkpoint, args.limit, args.batch_size, args.device)
        if args.json:
            print(json.dumps(results, indent=1))
        else:
            for r in results:
                print(format_result(r))
    else:
        from lmforge.train import evaluate_run

        m = evaluate_run(args.run_dir, args.checkpoint, args.split, args.batches, args.device)
        if args.json:
            print(json.dumps(m, indent=1))
        else:
            bpb = f", bits/byte {m['bpb']:.4f}" if m["bpb"] is not None else ""
            print(f"{m['checkpoint']} (step {m['step']}) on {m['split']} ({m['tokens']:,} tokens): loss "
                  f"{m['loss']:.4f}, perplexity {m['ppl']:.2f}{bpb}")
    if not args.no_card:
        write_run_card(args.run_dir)
    return 0


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    p.add_argument("--out", metavar="FILE.md", help="also write the comparison (markdown) to this file")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--no-card", action="store_true", help="do not (re)write each run's report.md/report.json")


def _report(args: argparse.Namespace) -> int:
    from lmforge.report import compare_runs, write_run_card

    if not args.no_card:
        for run in args.runs:
            print(f"wrote {write_run_card(run)}")
    text = compare_runs(args.runs, out=args.out, force=args.force)
    print(text)
    return 0


COMMANDS: dict[str, tuple[AddArgs, Handler]] = {"eval": (_eval_args, _eval), "report": (_report_args, _report)}
