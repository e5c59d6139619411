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
def _top_level_commands() -> list[Command]:
    return []


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
