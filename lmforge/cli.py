"""The ``lmforge`` command line: a table of subcommands, each parsing flags and calling one library function.

Errors in user input (``ValueError``, missing files, bad flags) print one line and exit with code 2;
no traceback. Nothing in the library imports this module.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from lmforge import __version__


class CLIError(Exception):
    """A user-facing error raised by a command handler (printed as one line, exit code 2)."""


# Each entry: (name, help, function that adds the subcommand's arguments, handler).
# Handlers take the parsed namespace and return an exit code.
Command = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


# ==================================================================================================
# tokenizer  (lmforge tokenizer train | encode | decode | stats)
# ==================================================================================================
def _tokenizer_commands() -> list[Command]:
    return []


# ==================================================================================================
# data  (lmforge data get | prepare | inspect)
# ==================================================================================================
def _data_commands() -> list[Command]:
    return []


# ==================================================================================================
# train / generate / speedrun / demo  (top-level commands)
# ==================================================================================================
def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML run config with model/optimizer/training/data sections (see examples/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, parsed as YAML (repeatable), e.g. --set training.max_steps=100")
    p.add_argument("--run-dir", default=None,
                   help="run directory (default: runs/<config name>); an existing one is resumed from its newest checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")


def _train_run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lmforge.train import load_run_config, train

    cfg = load_run_config(args.config, args.overrides)
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / Path(args.config).stem
    m = train(cfg, run_dir, progress=not args.no_progress)
    val = f", val loss {m['val_loss']:.4f} (bpb {m['val_bpb']:.4f})" if m.get("val_bpb") is not None else ""
    loss = f", train loss {m['loss']:.4f}" if m.get("loss") is not None else ""
    print(f"step {m['step']}{loss}{val}; run directory {run_dir}")
    return 0


def _top_level_commands() -> list[Command]:
    return [
        ("train", "pretrain a model from a YAML config (resumes automatically)", _train_args, _train_run),
    ]


# ==================================================================================================
# main
# ==================================================================================================
def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (also used by the tests that run ``--help`` on every command)."""
    parser = argparse.ArgumentParser(prog="lmforge", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"lmforge {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups = {
        "tokenizer": ("train, apply and inspect byte-level BPE tokenizers", _tokenizer_commands()),
        "data": ("download corpora, prepare token shards, inspect them", _data_commands()),
    }
    for group, (help_text, commands) in groups.items():
        gp = sub.add_parser(group, help=help_text, description=help_text)
        gsub = gp.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
        for name, help_, add_args, handler in commands:
            p = gsub.add_parser(name, help=help_, description=help_)
            add_args(p)
            p.set_defaults(_handler=handler)
    for name, help_, add_args, handler in _top_level_commands():
        p = sub.add_parser(name, help=help_, description=help_)
        add_args(p)
        p.set_defaults(_handler=handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lmforge`` console script."""
    import logging

    from lmforge.common import setup_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(logging.WARNING if args.quiet else logging.INFO)
    try:
        return int(args._handler(args) or 0)
    except (CLIError, ValueError, FileNotFoundError, IsADirectoryError, PermissionError) as e:
        print(f"lmforge: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lmforge: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `lmforge tokenizer encode ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
