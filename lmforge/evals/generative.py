"""Generative exact match on chat conversations, through the one ``Generator`` (and its engine and KV cache).

Each prompt is rendered by ``ChatFormat.render_for_completion``; replies are generated greedily, a batch of
prompts at a time, until ``<|assistant_end|>`` (or the end-of-text token, or ``max_new_tokens``); a reply is
correct when it equals the expected answer after stripping whitespace at both ends.
"""

from __future__ import annotations

from typing import Any, Sequence

from lmforge.chat import ChatFormat
from lmforge.evals.tasks import ChatItem
from lmforge.generate import Generator

__all__ = ["exact_match"]

EXTRA_NEW_TOKENS = 16
"""Tokens a reply may have beyond its answer's own count (so a wrong, longer reply is seen as wrong)."""


def exact_match(generator: Generator, items: Sequence[ChatItem], batch_size: int = 16) -> dict[str, Any]:
    """``{"n", "correct", "truncated", "replies"}`` of greedy replies to ``items`` compared with their answers.

    A prompt that leaves no room for the reply in the context is cut from the left (counted in ``truncated``).
    """
    tok = generator.tokenizer
    if tok is None:
        raise ValueError("the generator has no tokenizer; build it with Generator(model, tokenizer)")
    fmt = ChatFormat(tok)
    ctx = generator.cfg.context_length
    stop = [fmt.assistant_end_id] + ([tok.eot_id] if tok.eot_id is not None else [])
    prompts, budgets, truncated = [], [], 0
    for it in items:
        ids = fmt.render_for_completion(list(it.prompt))
        budget = min(len(tok.encode(it.answer.strip(), special="plain")) + EXTRA_NEW_TOKENS, ctx - 1)
        room = ctx + 1 - budget  # the last new token is never fed back
        if len(ids) > room:
            ids, truncated = ids[len(ids) - room:], truncated + 1
        prompts.append(ids)
        budgets.append(budget)
    replies: list[str] = []
    for i in range(0, len(prompts), batch_size):
        rows, n_new = prompts[i: i + batch_size], max(budgets[i: i + batch_size])
        longest = max(len(r) for r in rows)
        n_new = min(n_new, ctx + 1 - longest)
        outs = generator.generate_ids(rows, max_new_tokens=n_new, temperature=0.0, stop_ids=stop, overflow="stop")
        replies += [tok.decode(o) for o in outs]
    correct = [r.strip() == it.answer.strip() for r, it in zip(replies, items)]
    return {"n": len(items), "correct": correct, "truncated": truncated, "replies": replies}
