"""``lmforge chat --run DIR``: talk to a chat model in the terminal; ``lmforge chat render``: see how
conversations become tokens and which of them are trained.

On a terminal the reply streams after a ``you>`` prompt; with stdin not a terminal each input line is one user
message and each reply is printed on one line (newlines in it written as ``\n``), so a chat can be scripted.
Lines starting with ``/`` are commands (``/reset``, ``/system TEXT``, ``/quit``, ``/help``); notices go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, TextIO

from lmforge.chat import CHAT_SPECIAL_TOKENS, add_chat_tokens, render_jsonl_preview
from lmforge.cli import CLIError, positive_int
from lmforge.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from lmforge.chat.session import ChatSession

logger = logging.getLogger("lmforge")


def _render_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE.jsonl", help='conversations, one {"messages": [...]} object per line')
    p.add_argument("--tokenizer", required=True, metavar="T",
                   help="tokenizer file (lmforge JSON, HF tokenizer.json, or a run's tokenizer.json); chat tokens "
                        "it lacks are added in memory, as fine-tuning would add them")
    p.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                   help="highlight trained tokens in colour (auto: on a terminal), else mark them [[like this]]")


def _render(args: argparse.Namespace) -> int:
    tok = load_tokenizer(args.tokenizer)
    missing = [t for t in CHAT_SPECIAL_TOKENS if t not in tok.special_tokens]
    chat_tok = add_chat_tokens(tok) if missing else tok
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    preview = render_jsonl_preview(args.file, chat_tok, color)  # every line checked before anything is printed
    if missing:
        logger.info("%s lacks %d chat tokens; added in memory for this preview (ids %d..%d)", args.tokenizer,
                    len(missing), tok.vocab_size, chat_tok.vocab_size - 1)
    sys.stdout.write(preview)
    return 0


HELP = """commands inside the chat:
  /reset        forget the conversation (the system message stays)
  /system TEXT  set the system message (/system alone removes it)
  /quit         leave (as does Ctrl-D or Ctrl-C)"""


def _chat_args(p: argparse.ArgumentParser) -> None:
    p.description = ("Talk to a chat model (a run fine-tuned with `lmforge sft`): `lmforge chat --run DIR`. "
                     "Or render conversations to tokens: `lmforge chat render FILE.jsonl --tokenizer T`.")
    p.epilog = HELP + "\n\nWith stdin not a terminal, each input line is one message and each reply one output line."
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.usage = ("lmforge chat --run DIR [--system TEXT] [--temperature T] [--top-p P] [--max-new-tokens N] [--seed S] "
               "[...]\n       lmforge chat render FILE.jsonl --tokenizer T")
    p.add_argument("--run", metavar="DIR", help="the run to talk to (its tokenizer must hold the chat tokens)")
    p.add_argument("--checkpoint", metavar="FILE", help="a checkpoint file, or 'best' (default: the newest step)")
    p.add_argument("--system", metavar="TEXT", help="system message at the start of the conversation")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T", help="sampling temperature; 0 = greedy "
                   "(default 0.8)")
    p.add_argument("--top-k", type=positive_int, default=None, metavar="K", help="sample from the K likeliest tokens")
    p.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus sampling: the smallest set of "
                   "tokens with probability >= P")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, metavar="N", help="tokens per reply at most "
                   "(default 256)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="random seed, an integer in [-2**63, "
                   "2**63 - 1] (the same seed and messages give the same replies)")
    p.add_argument("--no-tools", action="store_true", help="do not run calculator calls (the model's "
                   "<|python_start|>...<|python_end|> stays text)")
    p.add_argument("--device", default="auto", help="cpu, cuda, mps or auto (default)")
    p.add_argument("--prefix-cache-mb", type=float, default=256, metavar="MB",
                   help="keep each turn's keys and values (prompt and reply) within MB MiB, so the next turn prefills "
                        "only its new messages (default 256; 0 = off)")
    p.add_argument("--no-draft", action="store_true", help="decode one token per pass: no prompt-lookup drafts "
                   "(drafting gives the same tokens in fewer passes)")
    sub = p.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", parser_class=type(p))
    rp = sub.add_parser("render", help="show a JSONL file's conversations as tokens, the trained ones highlighted",
                        description="show a JSONL file's conversations as tokens, the trained ones highlighted")
    _render_args(rp)


def _chat(args: argparse.Namespace) -> int:
    if args.subcommand == "render":
        return _render(args)
    if not args.run:
        raise CLIError("give --run DIR to talk to a chat model, or use `lmforge chat render FILE.jsonl --tokenizer T` "
                       "(see `lmforge chat --help`)")
    from lmforge.chat.session import ChatSession  # here: loads torch
    from lmforge.generate.sampling import check_seed

    check_seed(args.seed)  # before loading the model
    if not 0 <= args.prefix_cache_mb < float("inf"):
        raise CLIError(f"--prefix-cache-mb must be a non-negative number of MiB, got {args.prefix_cache_mb}")
    session = ChatSession.from_run(args.run, args.checkpoint, device=args.device, system=args.system,
                                   max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, tools=not args.no_tools)
    if args.prefix_cache_mb > 0:
        from lmforge.generate.prefix_cache import PrefixCache

        session.generator.prefix_cache = PrefixCache(int(args.prefix_cache_mb * 2**20))
    session.generator.speculative = not args.no_draft
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {args.run} (context {session.context_length} tokens). /help for commands, "
              "/quit or Ctrl-D to leave.", file=sys.stderr)
    try:
        _loop(session, sys.stdin, sys.stdout, interactive)
    except KeyboardInterrupt:
        print(file=sys.stderr)
    return 0


def _loop(session: "ChatSession", stdin: TextIO, out: TextIO, interactive: bool) -> None:
    """Read messages and commands until /quit or end of input; stream each reply to ``out``."""
    while True:
        if interactive:
            try:
                line = input("you> ")
            except EOFError:
                print(file=sys.stderr)
                return
        else:
            line = stdin.readline()
            if not line:
                return
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            cmd, _, rest = line.partition(" ")
            if cmd == "/quit":
                return
            if cmd == "/reset":
                session.reset()
                print("(conversation reset)", file=sys.stderr)
            elif cmd == "/system":
                session.set_system(rest.strip() or None)
                print(f"(system message {'set' if session.system else 'removed'})", file=sys.stderr)
            elif cmd == "/help":
                print(HELP, file=sys.stderr)
            else:
                print(f"unknown command {cmd}; {HELP}", file=sys.stderr)
            continue
        try:
            stream = session.send(line)
        except ValueError as e:  # a message too long for the context: say so, keep chatting
            print(f"lmforge: {e}", file=sys.stderr)
            if not interactive:
                out.write("\n")  # still one output line per input message
            continue
        if stream.reply.dropped_turns:
            print(f"(context full: dropped the {stream.reply.dropped_turns} oldest turn(s) of the conversation)",
                  file=sys.stderr)
        if interactive:
            out.write("model> ")
        for piece in stream:
            out.write(piece if interactive else piece.replace("\\", "\\\\").replace("\n", "\\n"))
            out.flush()
        out.write("\n")
        out.flush()
        reason = stream.reply.finish_reason
        if reason != "stop":
            print(f"(reply cut: {'max-new-tokens reached' if reason == 'length' else 'context full'})", file=sys.stderr)


COMMANDS = {"chat": (_chat_args, _chat)}
