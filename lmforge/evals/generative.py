"""Generative exact match on chat conversations, through the one row step (:meth:`RowStep.run
<lmforge.generate.rows.RowStep.run>`) on the ``Generator``'s engine.

Each prompt is rendered by ``ChatFormat.render_for_completion``; replies are decoded greedily, a batch of prompts
at a time, each row until ``<|assistant_end|>`` (or the end-of-text token) or its own budget: the answer's token
count plus :data:`EXTRA_NEW_TOKENS`, whatever else shares its batch, so scores do not depend on the batch size. A
reply is correct when its final text equals the expected answer (case included) after stripping whitespace at
both ends.

A reply that calls the calculator (``<|python_start|>EXPR<|python_end|>``) within its budget has it run the way the
chat runs it (:class:`~lmforge.chat.tools.ToolUse` feeds the tool's output back and generation goes on) and its
budget raised by :data:`TOOL_NEW_TOKENS` from that call; its final text is the assistant's text after the last tool
output (:func:`~lmforge.chat.session.messages_from_reply`), which is what a task file's final assistant message
holds.
"""

from __future__ import annotations

from typing import Any, Sequence

from lmforge.chat import ChatFormat
from lmforge.chat.session import messages_from_reply
from lmforge.chat.tools import ToolUse
from lmforge.evals.tasks import ChatItem
from lmforge.generate import Generator
from lmforge.generate.rows import Row

__all__ = ["exact_match", "reply_text", "is_exact_match"]

EXTRA_NEW_TOKENS = 16
"""Tokens a reply may have beyond its answer's own count (so a wrong, longer reply is seen as wrong)."""
TOOL_NEW_TOKENS = 64
"""Extra tokens for a reply that calls the calculator (the call, its output and the text after it)."""


def _final_text(fmt: ChatFormat, ids: list[int]) -> str:
    """The reply's last assistant text: after the last completed tool call, else the whole reply."""
    messages = messages_from_reply(fmt, ids)
    if messages and messages[-1]["role"] == "assistant" and "tool_call" not in messages[-1]:
        return messages[-1]["content"]
    return "" if messages else fmt.tokenizer.decode(ids)


def reply_text(fmt: ChatFormat, ids: list[int]) -> str:
    """The text a reply (its ids, without the stop token) is scored on: the assistant's text after its last
    calculator output when it called the calculator, else the whole reply decoded."""
    return _final_text(fmt, ids) if fmt.ids["<|python_start|>"] in ids else fmt.tokenizer.decode(ids)


def is_exact_match(text: str, answer: str) -> bool:
    """Whether a reply's text is the expected answer: equal after stripping whitespace at both ends (case kept)."""
    return text.strip() == answer.strip()


def _reply_row(fmt: ChatFormat, prompt: list[int], budget: int, tool_budget: int, stop: list[int],
               device: Any) -> Row:
    """A greedy row of ``budget`` sampled tokens whose first calculator call raises its budget to ``tool_budget``."""
    use = ToolUse(fmt)

    def feed(t: int) -> list[int] | None:
        if t == use.start_id and row.max_tokens == budget:
            row.max_tokens = tool_budget
        return use.feed(t)

    row = Row(prompt, budget, temperature=0.0, device=device, stop_ids=stop, tool=feed, count_forced=False)
    return row


def exact_match(generator: Generator, items: Sequence[ChatItem], batch_size: int = 16) -> dict[str, Any]:
    """``{"n", "correct", "truncated", "replies", "ended", "tool_calls"}`` of greedy replies to ``items``.

    ``correct[i]``: the reply's final text equals item ``i``'s answer; ``ended[i]``: the reply ended with
    ``<|assistant_end|>`` (or the end-of-text token) within its budget; ``tool_calls``: replies that called the
    calculator. A prompt that leaves no room for the reply in the context is cut from the left (counted in
    ``truncated``).
    """
    tok = generator.tokenizer
    if tok is None:
        raise ValueError("the generator has no tokenizer; build it with Generator(model, tokenizer)")
    fmt = ChatFormat(tok)
    ctx = generator.cfg.context_length
    stop = [fmt.assistant_end_id] + ([tok.eot_id] if tok.eot_id is not None else [])
    rows, truncated = [], 0
    for it in items:
        ids = fmt.render_for_completion(list(it.prompt))
        budget = min(len(tok.encode(it.answer.strip(), special="plain")) + EXTRA_NEW_TOKENS, ctx - 1)
        room = ctx + 1 - budget  # the last new token is never fed back
        if len(ids) > room:
            ids, truncated = ids[len(ids) - room:], truncated + 1
        tool_budget = max(1, min(budget + TOOL_NEW_TOKENS, ctx - len(ids)))
        rows.append(_reply_row(fmt, ids, budget, tool_budget, stop, generator.device))
    for i in range(0, len(rows), batch_size):
        generator.rows.run(generator.engine, [[r] for r in rows[i: i + batch_size]])
    for r in rows:
        if r.error is not None:
            raise ValueError(r.error)
    replies = [reply_text(fmt, r.ids) for r in rows]
    correct = [is_exact_match(r, it.answer) for r, it in zip(replies, items)]
    return {"n": len(items), "correct": correct, "truncated": truncated, "replies": replies,
            "ended": [r.finish == "stop" for r in rows], "tool_calls": sum(fmt.ids["<|python_start|>"] in r.ids
                                                                           for r in rows)}
