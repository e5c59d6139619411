"""Decode steps with fixed shapes, replayed as CUDA graphs: the engine's fast path on a GPU.

A small model's decode step on a GPU is bound by launching its kernels (a GPT-2-small step is ~200 of them, each
a few microseconds of work), not by the GPU. :class:`StepGraphs` runs the engine's step over a *static* view of the
KV cache (:attr:`lmforge.model.KVCache.static`: each row writes its own column, every query attends over the whole
capacity under a mask, no host sync), so the step's shapes and addresses are the same every time; on CUDA the
first step of each batch size runs eagerly and is then captured as a CUDA graph, which later steps replay: one
launch per token. Elsewhere (``capture=False``) the same static step runs eagerly: what tests hold against the
model's ordinary forward.

The graphs belong to one cache's storage: :meth:`reset` drops them when the engine builds another cache. A capture
that fails (a driver or library that refuses it) is logged once and decoding goes on without graphs.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import Tensor

from lmforge.model import KVCache

__all__ = ["StepGraphs"]

logger = logging.getLogger("lmforge")


class _Entry:
    """One batch size's static step: its cache view, input tokens, and (on CUDA) graph and output."""

    def __init__(self, view: KVCache, tokens: Tensor) -> None:
        self.view, self.tokens = view, tokens
        self.graph: Any = None
        self.out: Tensor | None = None
        self.kept: list[Tensor] = []


class StepGraphs:
    """``step(cache, tokens)``: one token per live row (rows ``0 .. B-1`` of ``cache``), next-token logits.

    ``run(tokens (B, 1), cache)`` is the engine's forward (logits ``(B, V)`` of the last column). ``capture``:
    replay each batch size's step as a CUDA graph after its first (eager) step; ``keep()`` lists tensors the
    step reads that no parameter or buffer owns (:func:`lmforge.model.cached_projections`): each graph holds them.
    """

    def __init__(self, run: Callable[[Tensor, KVCache], Tensor], capture: bool,
                 keep: Callable[[], list[Tensor]] = list) -> None:
        self.run, self.capture, self.keep = run, capture, keep
        self._entries: dict[int, _Entry] = {}
        self.captured = 0  # graphs captured since the last reset (tests and benchmarks read it)

    def reset(self) -> None:
        """Forget every graph (the cache they write into is gone)."""
        self._entries.clear()
        self.captured = 0

    def step(self, cache: KVCache, tokens: Tensor) -> Tensor:
        B = tokens.shape[0]
        e = self._entries.get(B)
        if e is None:
            view = cache.rows(slice(0, B))
            view.static = True
            e = self._entries[B] = _Entry(view, torch.empty(B, 1, dtype=torch.long, device=tokens.device))
        e.tokens.copy_(tokens[:, None])
        if e.graph is not None:
            e.graph.replay()
            return e.out.clone()  # the next replay overwrites it
        if not self.capture:
            return self.run(e.tokens, e.view)
        logits = self._warm(e)
        try:
            e.graph = self._capture(e)
        except RuntimeError as err:  # the step already ran: go on without graphs rather than fail the request
            logger.warning("decoding without CUDA graphs from now on: capturing the batch-%d step failed (%s)", B,
                           str(err).splitlines()[0] if str(err) else type(err).__name__)
            self.capture = False
            e.out = None
        else:
            e.kept = self.keep()
            self.captured += 1
        return logits

    def _warm(self, e: _Entry) -> Tensor:
        """The first step at a batch size, eagerly on a side stream (lazy initialisations must not be captured)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self.run(e.tokens, e.view)
        torch.cuda.current_stream().wait_stream(side)
        return logits

    def _capture(self, e: _Entry) -> Any:
        """The same step as a CUDA graph: capture records kernels without running them, so the cache is unchanged.
        Each graph has its own memory pool (replays of different batch sizes never share scratch memory)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            e.out = self.run(e.tokens, e.view)
        return graph
