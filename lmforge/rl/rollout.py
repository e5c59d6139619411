"""Rollouts: K sampled replies per prompt through the one generation engine, tool calls run as the chat runs them.

:func:`sample_replies` decodes a batch of prompts, ``K`` rows each, on an :class:`~lmforge.generate.engine.Engine`:
one prefill of every row, then one batched decode step per token. Each row samples with its own seeded
``torch.Generator`` (:func:`rollout_seed`), as the server's scheduler does per request, so a reply is a
function of its prompt, its seed, the weights and the batch it is decoded in; rows leave the batch as they
end. A calculator call is run by one :class:`~lmforge.chat.tools.ToolUse` per row, exactly as
:class:`~lmforge.chat.session.ChatSession` runs it through :meth:`Generator.turn
<lmforge.generate.generator.Generator.turn>`: each sampled id is fed to it, the output ids it returns are fed
to the model one per step before sampling goes on, and they belong to the reply but are not sampled (RL
masks them out of the loss). A reply ends at a stop id (``<|assistant_end|>``, end of text, ``<|user_start|>``:
the chat's), after ``max_new_tokens`` sampled ids, or when the next ids would not fit the context (no sliding).

The engine packs a copy of the weights for its decode kernel when it is built, so a new :class:`Engine` is
made from the model after every optimizer step (:class:`~lmforge.rl.source.RolloutSource`); packing a 5M
parameter model takes milliseconds (``benchmarks/bench_rl.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Any, Sequence

import torch

from lmforge.chat.format import ChatFormat
from lmforge.chat.tools import ToolUse
from lmforge.generate.sampling import sample_next
from lmforge.tokenizer import EOT

__all__ = ["Rollout", "rollout_seed", "sample_replies", "stop_ids"]


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


def stop_ids(fmt: ChatFormat) -> list[int]:
    """The ids that end a reply, as in the chat: ``<|assistant_end|>``, the end-of-text token, ``<|user_start|>``."""
    return [fmt.assistant_end_id, fmt.ids[EOT], fmt.ids["<|user_start|>"]]


class _Row:
    """A reply being decoded: its rollout, sampler, tool state, the ids still to feed, the cache's fill."""

    def __init__(self, prompt: list[int], seed: int, fmt: ChatFormat | None, device: torch.device) -> None:
        self.out = Rollout(prompt=list(prompt))
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.tool = ToolUse(fmt) if fmt is not None else None
        self.pending: collections.deque[int] = collections.deque()
        self.used = len(prompt)  # ids in the cache
        self.n = 0  # sampled ids


def _take(r: _Row, t: int, stops: set[int], max_new_tokens: int, ctx: int) -> None:
    """Row ``r`` sampled ``t``: record it (and a tool's output), or end the row (as ``Generator.turn``)."""
    out = r.out
    if t in stops:
        out.stop, out.finish = t, "stop"
        return
    r.n += 1
    out.ids.append(t)
    out.sampled.append(True)
    feed = [t]
    extra = r.tool.feed(t) if r.tool is not None else None
    if extra:
        out.ids.extend(extra)
        out.sampled.extend([False] * len(extra))
        out.tool_calls += 1
        feed.extend(extra)
    if r.n >= max_new_tokens:
        out.finish = "length"
    elif r.used + len(feed) > ctx:
        out.finish = "context"
    else:
        r.pending.extend(feed)


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
    rows = [_Row(p, s, fmt if tools else None, engine.device) for p, ss in zip(prompts, seeds) for s in ss]
    stops = set(stop_ids(fmt))

    def pick(r: _Row, logits: torch.Tensor) -> None:  # logits (V,)
        t = int(sample_next(logits[None, :vocab_limit], temperature, top_k, top_p, r.gen)[0])
        _take(r, t, stops, max_new_tokens, ctx)

    live = list(rows)  # live[b] decodes in engine row b
    with torch.inference_mode():
        logits = engine.prefill([r.out.prompt for r in rows], ctx)  # (B, V): the model's forward, all threads
    with torch.inference_mode(), engine.serial_torch():  # decode steps and sampling: see Engine.serial_torch
        for b, r in enumerate(live):
            pick(r, logits[b])
        while True:
            for b in sorted((b for b, r in enumerate(live) if r.out.finish), reverse=True):
                moved = engine.release(b)  # the last live row moves into row b
                if moved is not None:
                    live[b] = live[moved]
                live.pop()
            if not live:
                break
            feed = torch.tensor([r.pending.popleft() for r in live], dtype=torch.long, device=engine.device)
            logits = engine.step(feed)
            for b, r in enumerate(live):
                r.used += 1
                if not r.pending:  # a tool's output still to feed: no sampling until it is in
                    pick(r, logits[b])
    it = iter(r.out for r in rows)
    return [[next(it) for _ in ss] for ss in seeds]
