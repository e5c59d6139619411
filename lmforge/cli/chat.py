"""``lmforge chat render``: see how conversations become tokens and which of them are trained."""

from __future__ import annotations

import argparse
import logging
import sys

from lmforge.chat import CHAT_SPECIAL_TOKENS, add_chat_tokens, render_jsonl_preview
from lmforge.cli import Command
from lmforge.tokenizer import load_tokenizer

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


SUBCOMMANDS: list[Command] = [
    ("render", "show a JSONL file's conversations as tokens, the trained ones highlighted", _render_args, _render),
]
