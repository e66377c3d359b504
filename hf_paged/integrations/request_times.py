"""What a continuous-batching loop measured of its requests, as plain counts.

The loop's thread records a request once, when it finishes (its time to first token and its
time per output token after the first), and its tokens once a step: a few additions, no lock
and nothing of the metrics library, so that reporting costs the engine's step loop nothing
per token. A server reads the totals whenever it is asked (``/metrics``); nothing is drained,
so nothing is lost between reads and memory stays fixed.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

# Bucket upper bounds in seconds (Prometheus' ``le``): time to first token spans a decode step
# to a queue of minutes; time per output token a fast decode step to a stalled one.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
                0.075, 0.1, 0.25, 0.5, 1.0)


@dataclass
class Histogram:
    """Counts of observations at or below each bound (not cumulative; the last slot: above
    every bound) and their sum."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def __add__(self, other: Histogram) -> Histogram:
        """Both histograms' observations (data-parallel replicas' loops together)."""
        both = Histogram(self.bounds)
        both.counts = [a + b for a, b in zip(self.counts, other.counts)]
        both.total = self.total + other.total
        return both


@dataclass
class RequestTimes:
    """A loop's totals: tokens generated, requests finished, and the two latency histograms."""

    tokens: int = 0
    finished: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))

    def __add__(self, other: RequestTimes) -> RequestTimes:
        """Both loops' totals (data-parallel replicas' loops together)."""
        return RequestTimes(self.tokens + other.tokens, self.finished + other.finished,
                            self.ttft + other.ttft, self.tpot + other.tpot)

    def request_done(self, created: float, first_token: float | None, end: float,
                     num_tokens: int) -> None:
        """A request that arrived at ``created`` got its first token at ``first_token`` (None:
        none) and ended at ``end`` with ``num_tokens`` tokens (``time.perf_counter`` times)."""
        self.finished += 1
        if first_token is None:
            return
        self.ttft.observe(max(first_token - created, 0.0))
        if num_tokens > 1:
            self.tpot.observe(max(end - first_token, 0.0) / (num_tokens - 1))
