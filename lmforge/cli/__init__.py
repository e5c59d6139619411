"""The ``lmforge`` command line: a table of subcommands, each parsing flags and calling one library function.

One module per command group: :mod:`~lmforge.cli.tokenizer`, :mod:`~lmforge.cli.data`, :mod:`~lmforge.cli.train`
(train), :mod:`~lmforge.cli.midtrain`, :mod:`~lmforge.cli.sft` (sft, lora merge), :mod:`~lmforge.cli.rl`,
:mod:`~lmforge.cli.eval` (eval, report),
:mod:`~lmforge.cli.generate`, :mod:`~lmforge.cli.chat` (chat, chat render), :mod:`~lmforge.cli.serve`,
:mod:`~lmforge.cli.interop` (export, import), :mod:`~lmforge.cli.checkpoint` (consolidate),
:mod:`~lmforge.cli.speedrun`. The table below names the module of
each top-level command; only the module of the command being run is imported, so ``lmforge --help`` does not
load torch (or the library at all).

Errors in user input (``ValueError``, missing files, bad flags) print one line and exit with code 2;
no traceback. A failed memory allocation (a model, batch or context too large for the machine) prints one
line and exits with code 1. Nothing in the library imports this package.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys
from typing import Callable, NoReturn, Sequence

from lmforge import __version__
from lmforge.common import setup_logging


class CLIError(Exception):
    """A user-facing error raised by a command handler (printed as one line, exit code 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in one line (what is wrong, and where the help is), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


AddArgs = Callable[[argparse.ArgumentParser], None]
Handler = Callable[[argparse.Namespace], int]  # takes the parsed namespace, returns an exit code
# A group module's SUBCOMMANDS: its own table of (name, help, function adding the arguments, handler).
Command = tuple[str, str, AddArgs, Handler]

# The table: top-level name -> (help, module). A group's module lists its subcommands in SUBCOMMANDS
# (``lmforge data get``), or in the list named after a colon (``module:EXPORT``); a command's module maps
# the command's name to (add arguments, handler) in COMMANDS.
GROUPS = {
    "tokenizer": ("train, apply and inspect byte-level BPE tokenizers", "lmforge.cli.tokenizer"),
    "data": ("download corpora, prepare token shards, inspect them", "lmforge.cli.data"),
    "lora": ("LoRA adapters of a fine-tuning run: merge them into a plain run", "lmforge.cli.sft"),
    "export": ("export a run to Hugging Face transformers (hf) or llama.cpp (gguf)", "lmforge.cli.interop:EXPORT"),
    "import": ("import a Hugging Face Llama checkpoint as an lmforge run", "lmforge.cli.interop:IMPORT"),
    "checkpoint": ("sharded checkpoints: consolidate one into a single file", "lmforge.cli.checkpoint"),
}
COMMANDS = {
    "train": ("pretrain a model from a YAML config (resumes automatically)", "lmforge.cli.train"),
    "eval": ("a run's checkpoint: validation loss/perplexity/bits per byte, or --task accuracy (offline evals)",
             "lmforge.cli.eval"),
    "report": ("write each run's card (report.md + report.json) and compare runs side by side", "lmforge.cli.eval"),
    "midtrain": ("continue a pretrained run on its corpus mixed with chat conversations (every token trained, "
                 "before sft); resumes automatically", "lmforge.cli.midtrain"),
    "sft": ("fine-tune a run on conversations (JSONL messages), fully or with LoRA; resumes automatically",
            "lmforge.cli.sft"),
    "rl": ("reinforcement learning from verifiable rewards on a chat run (exact-match rewards, K samples per "
           "prompt, the same loop); resumes automatically", "lmforge.cli.rl"),
    "generate": ("generate text with a trained model (KV cache, sampling, streaming)", "lmforge.cli.generate"),
    "chat": ("talk to a chat model (--run DIR), or render conversations to tokens (chat render)", "lmforge.cli.chat"),
    "serve": ("serve a run over an OpenAI-compatible HTTP API and a web chat page (batched decoding)",
              "lmforge.cli.serve"),
    "speedrun": ("the whole pipeline on one corpus: tokenizer, shards, training, eval, samples, report.md",
                 "lmforge.cli.speedrun"),
}


def _add(sub: argparse._SubParsersAction, name: str, help_: str, add_args: AddArgs | None = None,
         handler: Handler | None = None) -> argparse.ArgumentParser:
    """Add subcommand ``name``; without ``add_args`` it is only listed (its module is not loaded)."""
    p = sub.add_parser(name, help=help_, description=help_)
    if add_args is not None:
        add_args(p)
        p.set_defaults(_handler=handler)
    return p


def build_parser(only: str | None = None, sub: str | None = None) -> argparse.ArgumentParser:
    """The argument parser (also used by the tests that run ``--help`` on every command).

    ``only``: build the arguments of this top-level command alone (the others are listed, not loaded);
    ``None`` builds them all. ``sub``: the parser for one command line that names ``only`` (and, for a group,
    its subcommand ``sub``): the other commands are not even listed (each listed command is an
    ``ArgumentParser`` to build: ~5 ms for the table on a short run such as ``tokenizer train``).
    """
    parser = _Parser(
        prog="lmforge",
        description="Build a language model from scratch: tokenizer -> token shards -> pretraining -> generation.",
        epilog="Run `lmforge COMMAND --help` for the options of each command.",
    )
    parser.add_argument("--version", action="version", version=f"lmforge {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    alone = only is not None and sub is not None  # one command line: build its path only
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    for group, (help_text, module) in GROUPS.items():
        if alone and group != only:
            continue
        gp = _add(subs, group, help_text)
        if only in (None, group):
            gsub = gp.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True, parser_class=_Parser)
            mod, _, table = module.partition(":")
            entries = getattr(importlib.import_module(mod), table or "SUBCOMMANDS")
            if alone and any(e[0] == sub for e in entries):
                entries = [e for e in entries if e[0] == sub]
            for name, help_, add_args, handler in entries:
                _add(gsub, name, help_, add_args, handler)
    for name, (help_, module) in COMMANDS.items():
        if alone and name != only:
            continue
        _add(subs, name, help_, *(importlib.import_module(module).COMMANDS[name] if only in (None, name) else ()))
    return parser


_ALLOCATION_FAILED = re.compile(r"can't allocate memory|out of memory|unable to allocate", re.IGNORECASE)


def allocation_failure(e: BaseException) -> str | None:
    """One line for a failed memory allocation (torch's ``RuntimeError`` "can't allocate memory" / CUDA out of
    memory, numpy's or Python's ``MemoryError``), or None for any other error."""
    text = str(e).strip()
    if not isinstance(e, MemoryError) and not (isinstance(e, RuntimeError) and _ALLOCATION_FAILED.search(text)):
        return None
    size = re.search(r"tried to allocate (\d+) bytes", text)
    if size:
        detail = f"an allocation of {int(size.group(1)) / 2**30:,.1f} GiB failed"
    else:  # numpy and CUDA name the size themselves; keep their first line without torch's "[enforce fail ...]"
        detail = re.sub(r"^\[enforce fail[^\]]*\][^:]*:\s*", "", text.splitlines()[0] if text else "") or \
            "an allocation failed"
    return (f"not enough memory: {detail}; a smaller model, context length, batch size or --max-new-tokens "
            "needs less")


def _command_in(argv: Sequence[str]) -> tuple[str | None, str | None]:
    """The top-level command named in ``argv`` (its first word that is not an option), if it is one we know,
    and the word after it (a group's subcommand, or None)."""
    words = iter(a for a in argv if not a.startswith("-"))
    word = next(words, None)
    if word not in GROUPS and word not in COMMANDS:
        return None, None
    return word, next(words, None) if word in GROUPS else ""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lmforge`` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    only, sub = _command_in(argv)
    args = build_parser(only=only or "", sub=sub).parse_args(argv)
    setup_logging(logging.WARNING if args.quiet else logging.INFO)
    try:
        return int(args._handler(args) or 0)
    except (CLIError, ValueError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
            PermissionError) as e:
        print(f"lmforge: error: {e}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as e:
        line = allocation_failure(e)
        if line is None:
            raise
        print(f"lmforge: error: {line}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("lmforge: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `lmforge tokenizer encode ... | head`
        return 0
