"""A request's answer as the scheduler's updates arrive: one choice of a plain answer (:class:`Choice`: text,
log-probabilities, function calls, why it ended) and the latency metrics of its tokens (:class:`Timing`)."""

from __future__ import annotations

import time
from typing import Any

from lmforge.generate.scheduler import Job, Update
from lmforge.serve import structured
from lmforge.serve.metrics import Metrics

__all__ = ["Choice", "Timing"]


class Choice:
    """One choice of a plain (non-streamed) answer to ``job``, as its updates arrive."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.parts: list[str] = []
        self.lps: list[Any] = []
        self.calls: list[dict[str, Any]] = []
        self.last: Update | None = None

    def add(self, u: Update) -> None:
        """Take ``u``; APIError 400 if the request's grammar failed (:func:`~lmforge.serve.structured.reply_end`)."""
        self.parts.append(u.text + structured.reply_end(self.job, u))
        self.lps.extend(u.logprobs)
        self.calls.extend(structured.parse_call(t) for t in u.regions)
        if u.finish_reason is not None:
            self.last = u

    def text(self) -> str:
        return "".join(self.parts)

    def finish(self) -> str:
        assert self.last is not None
        return "tool_calls" if self.calls and self.last.finish_reason == "stop" else str(self.last.finish_reason)


class Timing:
    """Time to first token and inter-token latency of one request's choices, into ``metrics``."""

    def __init__(self, metrics: Metrics, n: int) -> None:
        self.metrics, self.t0 = metrics, time.perf_counter()
        self.seen = [0] * n
        self.at = [self.t0] * n

    def update(self, k: int, u: Update) -> None:
        now, new = time.perf_counter(), u.completion_tokens - self.seen[k]
        if new <= 0:
            return
        if self.seen[k] == 0:
            self.metrics.first_token(now - self.t0)
            new -= 1
        self.metrics.between_tokens(now - self.at[k], new)
        self.seen[k], self.at[k] = u.completion_tokens, now
