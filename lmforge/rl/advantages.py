"""From rewards to the loss: group advantages, and rollouts as ``(x, y, weights)`` micro-batches for the loop.

**Advantages.** The ``K`` replies to one prompt are a group; reply ``k``'s advantage is its reward minus the
group's mean (``A = r - mean(r)``), optionally divided by the group's standard deviation (``rl.std_advantages``;
population std, plus 1e-4 so a group of equal rewards stays at 0). A group whose replies all score the same
teaches nothing (every advantage 0) but its tokens still count in the loss's denominator.

**The loss** is REINFORCE on the sampled tokens: with ``n`` the number of sampled tokens of the whole step (every
reply, every rank: the loop's global target count), ``loss = -(1/n) sum_t A_t log p(y_t)``, where ``A_t`` is the
advantage of the reply token ``t`` belongs to and ``p`` the distribution the rollouts sampled from (the logits
divided by ``rl.temperature``: :meth:`lmforge.rl.source.RolloutSource.tempered`). The loop computes it as its
masked cross-entropy with a weight per target (``TransformerLM.forward(..., weights=)``): targets are the reply's
sampled ids (the stop id included), a tool's output and the prompt are
:data:`~lmforge.data.conversations.IGNORE_INDEX`, as SFT masks them. With ``rl.kl_coef = b > 0`` each sampled
token's weight becomes ``A_t - b (log p(y_t) - log p_ref(y_t))``, ``p_ref`` the starting model (at the same
temperature). In expectation that term is the gradient of ``b sum_t KL(p(.|c_t) || p_ref(.|c_t))``, the
per-position KLs at the sampled contexts ``c_t`` *held fixed*: it is not the score-function gradient of the
reply-level ``b KL(p || p_ref)``, which would weight token ``t`` by the sum of the log-ratios from ``t`` to the
reply's end (how a change at ``t`` moves the later contexts is left out).

Worked example (one prompt, K = 2, rewards 1 and 0, so advantages +0.5 and -0.5): reply 0 is ``a b <end>``,
reply 1 is ``<python_start> 2 <python_end> <output_start> 4 <output_end> c`` (ended by the length limit); the
targets of reply 1 are its sampled ids, with the three ids of the tool output and the prompt ignored, and every
target of reply 0 weighs +0.5, of reply 1 -0.5; ``n`` = 3 + 4 = 7.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lmforge.data.conversations import IGNORE_INDEX
from lmforge.rl.rollout import Rollout

__all__ = ["STD_EPS", "group_advantages", "rollout_rows", "rollout_batches"]

STD_EPS = 1e-4
"""Added to a group's reward standard deviation before dividing by it (``rl.std_advantages``)."""


def group_advantages(rewards: torch.Tensor, std: bool = False) -> torch.Tensor:
    """``rewards (P, K)`` -> advantages ``(P, K)``: each reward minus its row's mean (÷ its row's std + 1e-4 with
    ``std``). ``ValueError`` for ``K < 2`` (the advantage of a group of one is always 0)."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be (prompts, K >= 2) for group-mean advantages, got shape "
                         f"{tuple(rewards.shape)}; a group of one reply always has advantage 0")
    r = rewards.double()
    a = r - r.mean(dim=1, keepdim=True)
    if std:
        a = a / (r.std(dim=1, unbiased=False, keepdim=True) + STD_EPS)
    return a.float()


def rollout_rows(rollout: Rollout, context_length: int) -> tuple[list[int], list[int]]:
    """``(ids, trained)`` of one rollout: prompt, reply and stop id, with 1 where the id is a target the policy
    gradient trains (sampled by the model) and 0 elsewhere (prompt, tool output); cut to ``context_length + 1``
    ids (only a tool's output fed at the very end can reach past it, and it is not trained)."""
    ids = rollout.prompt + rollout.ids + ([rollout.stop] if rollout.stop is not None else [])
    trained = [0] * len(rollout.prompt) + [int(s) for s in rollout.sampled] + ([1] if rollout.stop is not None else [])
    return ids[: context_length + 1], trained[: context_length + 1]


def rollout_batches(rollouts: Sequence[Rollout], weights: Sequence[Sequence[float]], micro_batch: int,
                    context_length: int, pad_id: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The rollouts as ``(x, y, w)`` micro-batches of ``micro_batch`` rows, in order, each padded to its longest row.

    ``weights[i]``: one weight per reply id of rollout ``i`` (its advantage, or with a KL penalty per token);
    ``x (B, T)`` int64 input ids (``pad_id`` after a row's end), ``y (B, T)`` targets (``IGNORE_INDEX`` where not
    trained), ``w (B, T)`` float32 (0 where not trained).
    """
    assert len(rollouts) % micro_batch == 0, (len(rollouts), micro_batch)
    out = []
    for s in range(0, len(rollouts), micro_batch):
        rows = [rollout_rows(r, context_length) for r in rollouts[s:s + micro_batch]]
        T = max(len(ids) for ids, _ in rows) - 1
        x = torch.full((len(rows), T), pad_id, dtype=torch.long)
        y = torch.full((len(rows), T), IGNORE_INDEX, dtype=torch.long)
        w = torch.zeros(len(rows), T)
        for b, ((ids, trained), r, ws) in enumerate(zip(rows, rollouts[s:s + micro_batch], weights[s:s + micro_batch])):
            n, start = len(ids) - 1, len(r.prompt)  # targets ids[1:]; reply id j is target start - 1 + j
            x[b, :n] = torch.tensor(ids[:-1])
            t = torch.tensor(ids[1:])
            keep = torch.tensor(trained[1:], dtype=torch.bool)
            y[b, :n] = torch.where(keep, t, torch.full_like(t, IGNORE_INDEX))
            per_id = torch.zeros(n)
            m = min(len(ws), n - (start - 1))
            per_id[start - 1: start - 1 + m] = torch.as_tensor(list(ws[:m]), dtype=torch.float32)
            w[b, :n] = per_id * keep
        out.append((x, y, w))
    return out
