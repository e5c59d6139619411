"""Generative exact match on chat conversations, through the one ``Generator`` (and its engine and KV cache).

Each prompt is rendered by ``ChatFormat.render_for_completion``; replies are generated greedily, a batch of
prompts at a time, until ``<|assistant_end|>`` (or the end-of-text token, or its own budget: the answer's token
count plus :data:`EXTRA_NEW_TOKENS`, whatever else shares its batch, so scores do not depend on the batch size);
a reply is correct when its final text equals the expected answer (case included) after stripping whitespace at
both ends.

A reply that calls the calculator (``<|python_start|>EXPR<|python_end|>``) is generated again alone, the way the
chat runs it (:class:`~lmforge.chat.tools.ToolUse` feeds the tool's output back and generation goes on); its
final text is the assistant's text after the last tool output (:func:`~lmforge.chat.session.messages_from_reply`),
which is what a task file's final assistant message holds.
"""

from __future__ import annotations

from typing import Any, Sequence

from lmforge.chat import ChatFormat
from lmforge.chat.session import messages_from_reply
from lmforge.chat.tools import ToolUse
from lmforge.evals.tasks import ChatItem
from lmforge.generate import Generator

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
    prompts, budgets, truncated = [], [], 0
    for it in items:
        ids = fmt.render_for_completion(list(it.prompt))
        budget = min(len(tok.encode(it.answer.strip(), special="plain")) + EXTRA_NEW_TOKENS, ctx - 1)
        room = ctx + 1 - budget  # the last new token is never fed back
        if len(ids) > room:
            ids, truncated = ids[len(ids) - room:], truncated + 1
        prompts.append(ids)
        budgets.append(budget)
    call = fmt.ids["<|python_start|>"]
    replies: list[str] = []
    ended: list[bool] = []
    tool_calls = 0
    for i in range(0, len(prompts), batch_size):
        rows, own = prompts[i: i + batch_size], budgets[i: i + batch_size]
        # One pass to the batch's largest budget; each row is then cut to its own, so a reply (and whether it
        # ended or called the calculator) never depends on its batch. A row past the context slides: only its
        # tokens after its own budget (which always fits, see above) are affected, and those are cut.
        outs = generator.generate_ids(rows, max_new_tokens=max(own), temperature=0.0, stop_ids=stop,
                                      overflow="slide")
        for row, budget, full in zip(rows, own, outs):
            out = full[:budget]
            if call not in out:
                replies.append(reply_text(fmt, out))
                ended.append(len(full) < budget)  # stopped before its budget: an end token
                continue
            tool_calls += 1  # run it again as the chat does: the calculator's output is fed back
            turn = generator.turn(row, max_new_tokens=max(1, min(budget + TOOL_NEW_TOKENS, ctx - len(row))),
                                  temperature=0.0, stop_ids=stop, inject=ToolUse(fmt).feed)
            for _ in turn:
                pass
            replies.append(reply_text(fmt, turn.ids))
            ended.append(turn.finish_reason == "stop")
    correct = [is_exact_match(r, it.answer) for r, it in zip(replies, items)]
    return {"n": len(items), "correct": correct, "truncated": truncated, "replies": replies, "ended": ended,
            "tool_calls": tool_calls}
