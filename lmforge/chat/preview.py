"""Show which tokens of a rendered conversation are trained: ANSI colour on a terminal, ``[[...]]`` otherwise.

>>> from lmforge.tokenizer import Tokenizer
>>> tok = Tokenizer({i: bytes([i]) for i in range(256)}, [])  # bytes only: one token per character here
>>> render_preview(tok.encode("Q? A."), [0, 0, 0, 1, 1], tok, color=False)
'Q? [[A.]]'
"""

from __future__ import annotations

import os
from itertools import groupby
from typing import Sequence

from lmforge.chat.format import ChatFormat, read_conversations
from lmforge.tokenizer import Tokenizer

__all__ = ["render_preview", "render_jsonl_preview"]

TRAINED_ON = "\x1b[1;32m"  # bold green
RESET = "\x1b[0m"


def render_preview(ids: Sequence[int], mask: Sequence[int], tokenizer: Tokenizer, color: bool) -> str:
    """The decoded text of ``ids`` with the runs where ``mask`` is 1 in bold green (``color``) or in ``[[...]]``.

    Each run is decoded whole, so a character split over tokens shows as itself.
    """
    if len(ids) != len(mask):
        raise ValueError(f"ids and mask differ in length ({len(ids)} vs {len(mask)}); pass what render returned")
    parts = []
    pos = 0
    for trained, run in groupby(mask):
        n = len(list(run))
        text = tokenizer.decode(ids[pos:pos + n])
        pos += n
        if trained:
            text = f"{TRAINED_ON}{text}{RESET}" if color else f"[[{text}]]"
        parts.append(text)
    return "".join(parts)


def render_jsonl_preview(path: str | os.PathLike, tokenizer: Tokenizer, color: bool) -> str:
    """Every conversation of a ``{"messages": [...]}`` JSONL file rendered and previewed (``lmforge chat render``).

    One header line per conversation (line number, tokens, trained tokens), then its preview.
    """
    fmt = ChatFormat(tokenizer)
    blocks = []
    for lineno, messages in read_conversations(path):
        ids, mask = fmt.render(messages)
        blocks.append(f"--- line {lineno}: {len(ids)} tokens, {sum(mask)} trained ---\n"
                      + render_preview(ids, mask, tokenizer, color))
    return "\n".join(blocks) + "\n"
