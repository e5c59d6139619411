"""The server's Prometheus metrics (``GET /metrics``, text exposition format 0.0.4), written directly.

Counters: requests by endpoint and status, prompt and generated tokens; gauges: rows decoding and requests waiting
(read from the scheduler when scraped); histograms: time to first token and inter-token latency (seconds), each
observed per request from the updates the engine thread sends.
"""

from __future__ import annotations

import bisect
import threading
from typing import Callable

__all__ = ["Histogram", "Metrics"]

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    """Cumulative buckets (``le``), sum and count, as Prometheus histograms are exposed."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: +Inf only
        self.sum, self.count = 0.0, 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for le, c in zip([*map(repr, self.buckets), "+Inf"], self.counts):
            total += c
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        return out + [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]


class Metrics:
    """What ``/metrics`` shows; thread-safe. ``load()`` gives the scheduler's ``{"active", "waiting", ...}``."""

    def __init__(self, load: Callable[[], dict[str, int]]) -> None:
        self.load = load
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[endpoint, status] = self.requests.get((endpoint, status), 0) + 1

    def tokens(self, prompt: int, generated: int) -> None:
        with self.lock:
            self.prompt_tokens += prompt
            self.generated_tokens += generated

    def first_token(self, seconds: float) -> None:
        with self.lock:
            self.ttft.observe(seconds)

    def between_tokens(self, seconds: float, tokens: int) -> None:
        """``tokens`` more tokens arrived ``seconds`` after the previous ones: ``tokens`` observations of the mean gap."""
        if tokens > 0:
            with self.lock:
                self.itl.observe(seconds / tokens, tokens)

    def text(self) -> str:
        load = self.load()
        with self.lock:
            lines = ["# HELP lmforge_requests_total Requests answered, by endpoint and HTTP status.",
                     "# TYPE lmforge_requests_total counter"]
            lines += [f'lmforge_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                      for (e, s), n in sorted(self.requests.items())]
            lines += ["# HELP lmforge_prompt_tokens_total Prompt tokens of the requests that ran.",
                      "# TYPE lmforge_prompt_tokens_total counter", f"lmforge_prompt_tokens_total {self.prompt_tokens}",
                      "# HELP lmforge_generation_tokens_total Tokens generated.",
                      "# TYPE lmforge_generation_tokens_total counter",
                      f"lmforge_generation_tokens_total {self.generated_tokens}",
                      "# HELP lmforge_requests_running Requests decoding now (one cache row each).",
                      "# TYPE lmforge_requests_running gauge", f"lmforge_requests_running {load['active']}",
                      "# HELP lmforge_requests_waiting Requests queued for a free row.",
                      "# TYPE lmforge_requests_waiting gauge", f"lmforge_requests_waiting {load['waiting']}",
                      "# HELP lmforge_time_to_first_token_seconds From submission to the first generated token.",
                      "# TYPE lmforge_time_to_first_token_seconds histogram",
                      *self.ttft.lines("lmforge_time_to_first_token_seconds"),
                      "# HELP lmforge_inter_token_latency_seconds Time between consecutive generated tokens.",
                      "# TYPE lmforge_inter_token_latency_seconds histogram",
                      *self.itl.lines("lmforge_inter_token_latency_seconds")]
        return "\n".join(lines) + "\n"
