"""How one optimizer step's batch is split over ranks and micro-batches: :func:`plan_batch`.

Two ways to size a step (``training`` section):

* ``global_batch_size: G`` (sequences per optimizer step over all ranks) is the invariant: the same config
  gives the same optimisation at 1, 2 or N processes. Each rank runs ``accum_steps`` micro-batches of
  ``micro_batch`` sequences with ``G = world_size x micro_batch x accum_steps``. ``micro_batch`` is
  ``training.micro_batch_size`` when set (a memory cap), else ``G / world_size`` (no accumulation).
  ``batch_size`` and ``grad_accum_steps`` are then not used for training.
* ``global_batch_size: null`` (the default): ``batch_size`` sequences per micro-batch on each rank and
  ``grad_accum_steps`` micro-batches, so the global batch is ``batch_size x grad_accum_steps x world_size``
  and changes with the number of processes.

Batch-size warm-up (``training.batch_warmup_steps``): the first steps train on fewer rows of each micro-batch
(:func:`warmup_rows`), so the global batch grows from ``batch_warmup_start`` of its rows to all of them. The loader
still hands every step its whole share of blocks; the rows a warm-up step leaves out are skipped, not postponed,
so the data order, and with it exact resume, is the same as without the warm-up.

Example: ``G = 16`` at world 2 with ``micro_batch_size: 4`` gives 2 micro-batches of 4 per rank; at world 1,
4 micro-batches of 4. The data loader hands step ``s`` the global blocks ``[s*G, (s+1)*G)`` of its epoch
order whatever the split (see :class:`lmforge.data.BlockLoader`), so both runs see the same samples.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["BatchPlan", "plan_batch", "warmup_rows"]


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """One optimizer step: ``global_batch`` sequences = ``world_size`` x ``micro_batch`` x ``accum_steps``."""

    global_batch: int
    micro_batch: int
    accum_steps: int
    world_size: int

    def tokens_per_step(self, context_length: int) -> int:
        """Tokens of one optimizer step over all ranks."""
        return self.global_batch * context_length


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_batch(tc: Any, world_size: int) -> BatchPlan:
    """The step layout for a :class:`~lmforge.train.config.TrainingConfig` ``tc`` at ``world_size`` processes.

    Raises ``ValueError`` naming the world sizes and micro-batch sizes that work when ``global_batch_size``
    cannot be split evenly.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    G = tc.global_batch_size
    if G is None:
        return BatchPlan(tc.batch_size * tc.grad_accum_steps * world_size, tc.batch_size, tc.grad_accum_steps,
                         world_size)
    if G % world_size:
        ok = ", ".join(map(str, _divisors(G)))
        raise ValueError(f"training.global_batch_size={G} cannot be split over {world_size} processes; run with a "
                         f"world size that divides it ({ok}) or set a global_batch_size divisible by {world_size}")
    per_rank = G // world_size
    micro = tc.micro_batch_size or per_rank
    if per_rank % micro:
        ok = ", ".join(map(str, _divisors(per_rank)))
        raise ValueError(f"training.global_batch_size={G} over {world_size} processes is {per_rank} sequences per "
                         f"rank, not a multiple of training.micro_batch_size={micro}; set micro_batch_size to one "
                         f"of {ok}")
    return BatchPlan(G, micro, per_rank // micro, world_size)


def warmup_rows(step: int, rows: int, warmup_steps: int, start: float) -> int:
    """Rows of each ``rows``-row micro-batch that the optimizer step with 0-based index ``step`` trains on.

    Linear from ``start`` x ``rows`` at step 0 to ``rows`` at step ``warmup_steps`` (and after), rounded up, at
    least 1. Example: ``rows=16, warmup_steps=4, start=0.25`` gives 4, 7, 10, 13, 16, 16, ...
    """
    if step >= warmup_steps:
        return rows
    frac = start + (1.0 - start) * step / warmup_steps
    return max(1, min(rows, math.ceil(round(frac * rows, 9))))
