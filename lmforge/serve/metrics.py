"""The server's Prometheus metrics (``GET /metrics``), kept and written by ``prometheus_client``.

Counted as answers go out: requests by endpoint and status (every answer but a 401), prompt and generated tokens, time
to first token and inter-token latency; read when scraped: :data:`_SERIES` (totals: no label names a key or tenant).
Each app has its own registry (several apps in one process do not share counts). The ``endpoint`` label is a route's
path template (``/v1/models/{name}``) or ``other``, never a path a client wrote: the number of series is bounded
whatever clients send.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

__all__ = ["CONTENT_TYPE", "ITL_BUCKETS", "Metrics", "TTFT_BUCKETS"]

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
"""The exposition format served: Prometheus text 0.0.4, which every scraper reads."""


_G, _C = GaugeMetricFamily, CounterMetricFamily  # each series' kind
_SERIES = (
    ("active", _G, "lmforge_requests_running", "Requests decoding now (one cache row each)."),
    ("waiting", _G, "lmforge_requests_waiting", "Requests queued for a free row."),
    ("prefix_queries", _C, "lmforge_prefix_cache_queries", "Prompts looked up in the prefix cache."),
    ("prefix_hits", _C, "lmforge_prefix_cache_hits", "Prompts that started with a cached prefix."),
    ("prefix_query_tokens", _C, "lmforge_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache."),
    ("prefix_hit_tokens", _C, "lmforge_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache "
     "(not prefilled)."),
    ("prefix_evicted_blocks", _C, "lmforge_prefix_cache_evicted_blocks", "Blocks the prefix cache dropped (least "
     "recently used) to stay within its budget."),
    ("spec_passes", _C, "lmforge_speculative_passes", "Passes that checked drafted tokens."),
    ("spec_drafted", _C, "lmforge_speculative_drafted_tokens", "Tokens drafted from a request's own context."),
    ("spec_accepted", _C, "lmforge_speculative_accepted_tokens", "Drafted tokens kept (decoded without a step of "
     "their own)."),
    ("prefix_bytes", _G, "lmforge_prefix_cache_bytes", "Bytes of keys and values the prefix cache holds."),
    ("responses_stored", _G, "lmforge_responses_stored", "Responses the Responses API holds (store: true), over "
     "every API key."),
    ("responses_stored_bytes", _G, "lmforge_responses_stored_bytes", "Bytes the stored responses take, as their "
     "per-key budget counts them (--responses-store-mb), over every API key."))
"""What a scrape reads from ``load()``: its key, the metric's kind, name and help."""


class Metrics:
    """What ``/metrics`` shows; thread-safe. ``load()`` gives every key of :data:`_SERIES`."""

    def __init__(self, load: Callable[[], dict[str, int]]) -> None:
        self.load = load
        self.registry = r = CollectorRegistry()
        self._requests = Counter("lmforge_requests", "Requests answered, by endpoint (route template) and HTTP "
                                 "status.", ["endpoint", "status"], registry=r)
        self._prompt = Counter("lmforge_prompt_tokens", "Prompt tokens of the requests that ran.", registry=r)
        self._generated = Counter("lmforge_generation_tokens", "Tokens generated.", registry=r)
        r.register(self)  # its collect() reads load() at each scrape
        self._ttft = Histogram("lmforge_time_to_first_token_seconds", "From submission to the first generated "
                               "token.", buckets=TTFT_BUCKETS, registry=r)
        self._itl = Histogram("lmforge_inter_token_latency_seconds", "Time between consecutive generated tokens.",
                              buckets=ITL_BUCKETS, registry=r)

    def collect(self) -> Iterator[Metric]:
        """The series of :data:`_SERIES`, read once per scrape (the registry calls it)."""
        now = self.load()
        for key, family, name, text in _SERIES:
            yield family(name, text, value=now[key])

    def request(self, endpoint: str, status: int) -> None:
        """Count one answer; ``endpoint`` must be a route template or ``other`` (never a client's path)."""
        self._requests.labels(endpoint, str(status)).inc()

    def tokens(self, prompt: int, generated: int) -> None:
        self._prompt.inc(prompt)
        self._generated.inc(generated)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def between_tokens(self, seconds: float, tokens: int) -> None:
        """``tokens`` more tokens came ``seconds`` after the previous ones: ``tokens`` observations of the mean gap."""
        for _ in range(tokens):
            self._itl.observe(seconds / tokens)

    def text(self) -> bytes:
        """The exposition (:data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)
