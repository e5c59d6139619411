"""Rollouts: K sampled replies per prompt through the row step, tool calls run as the chat runs them.

:func:`sample_replies` decodes a batch of prompts, ``K`` rows each, through :meth:`RowStep.run
<lmforge.generate.rows.RowStep.run>` (each prompt prefilled once, its row forked into its other ``K - 1``). Each row
samples with its own seeded ``torch.Generator`` (:func:`rollout_seed`), so a reply is a function of its prompt, its
seed, the weights and the batch it is decoded in. A calculator call is run by one :class:`~lmforge.chat.tools.ToolUse`
per row, as :class:`~lmforge.chat.session.ChatSession` runs it: its output ids belong to the reply but are not
sampled (RL masks them out of the loss). A reply ends at a stop id (``ChatFormat.stop_ids``), after
``max_new_tokens`` sampled ids, or when the next ids would not fit the context (no sliding).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Sequence

from lmforge.chat.format import ChatFormat
from lmforge.chat.tools import ToolUse
from lmforge.generate.rows import Row, RowStep, token_bytes

__all__ = ["Rollout", "rollout_seed", "sample_replies"]


@dataclasses.dataclass
class Rollout:
    """One sampled reply to a prompt."""

    prompt: list[int]
    """The prompt's ids (the conversation rendered for completion, ending with ``<|assistant_start|>``)."""
    ids: list[int] = dataclasses.field(default_factory=list)
    """The reply's ids in order, sampled and forced (tool output) ones, without the stop id."""
    sampled: list[bool] = dataclasses.field(default_factory=list)
    """Per id of ``ids``: True when the model sampled it, False when a tool's output forced it."""
    stop: int | None = None
    """The stop id that ended the reply (sampled, so trained), or None when it ended on a limit."""
    finish: str = ""
    """``stop``, ``length`` (``max_new_tokens`` sampled) or ``context`` (the context is full)."""
    tool_calls: int = 0
    """Calculator calls completed in the reply."""

    @property
    def sampled_count(self) -> int:
        """Ids the model sampled, the stop id included: the tokens the policy gradient trains."""
        return sum(self.sampled) + (self.stop is not None)


def rollout_seed(seed: int, step: int, prompt: int, sample: int) -> int:
    """The sampling seed of reply ``sample`` to prompt slot ``prompt`` of step ``step`` in a run seeded ``seed``:
    64 bits of BLAKE2b over the four numbers (in [0, 2**63), any process, any world size)."""
    h = hashlib.blake2b(f"lmforge-rl:{seed}:{step}:{prompt}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


def sample_replies(engine: Any, prompts: Sequence[Sequence[int]], seeds: Sequence[Sequence[int]], *,
                   temperature: float, top_k: int | None, top_p: float | None, max_new_tokens: int,
                   fmt: ChatFormat, vocab_limit: int, tools: bool = True) -> list[list[Rollout]]:
    """``len(seeds[i])`` replies to each prompt ``i``, every row of every prompt decoded as one batch on ``engine``.

    ``seeds[i][k]`` seeds reply ``k`` of prompt ``i``; ``vocab_limit``: ids at or past it (the model's padding rows)
    are never sampled; ``tools``: run calculator calls. Returns the rollouts per prompt, in seed order.
    """
    ctx = engine.context_length
    for p in prompts:
        if not 0 < len(p) < ctx:
            raise ValueError(f"a prompt of {len(p)} tokens leaves no room for a reply in a context of {ctx}")

    def row(prompt: Sequence[int], seed: int) -> Row:
        tool = ToolUse(fmt) if tools else None  # its calls are counted from the row's owner
        return Row(list(prompt), max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                   device=engine.device, stop_ids=fmt.stop_ids, tool=tool.feed if tool else None, count_forced=False,
                   owner=tool)

    groups = [[row(p, s) for s in ss] for p, ss in zip(prompts, seeds)]
    RowStep(token_bytes(fmt.tokenizer)[:vocab_limit]).run(engine, groups)
    return [[_rollout(r) for r in g] for g in groups]


def _rollout(r: Row) -> Rollout:
    if r.error is not None:
        raise ValueError(r.error)
    return Rollout(prompt=list(r.prompt), ids=r.ids, sampled=r.sampled, stop=r.stop, finish=r.finish or "",
                   tool_calls=len(r.owner.calls) if r.owner is not None else 0)
