"""Per-second figures of recent inference traffic, for the status page's chart.

A ring of ``capacity`` one-second buckets keyed by whole wall-clock seconds: each finished
inference request adds its latency and whether it failed (status >= 400). ``points()``
turns the ring into a gap-free series (quiet seconds are zeros) with throughput, error
count and p50/p99 latency per second. Latencies within one second are kept exactly (at
most ``MAX_SAMPLES`` per second; past that a reservoir keeps a fair sample), so the
percentiles are real ones, not bucket estimates.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_CAPACITY_S = 300
MAX_SAMPLES = 2048


@dataclass
class _Second:
    second: int
    requests: int = 0
    errors: int = 0
    latencies_s: list[float] = field(default_factory=list)

    def add(self, seconds: float, failed: bool, rng: random.Random) -> None:
        self.requests += 1
        self.errors += int(failed)
        if len(self.latencies_s) < MAX_SAMPLES:
            self.latencies_s.append(seconds)
        else:  # reservoir sampling: every request had the same chance to be kept
            slot = rng.randrange(self.requests)
            if slot < MAX_SAMPLES:
                self.latencies_s[slot] = seconds


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in 0..100)."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


class TimeSeries:
    """The last ``capacity_s`` seconds of request counts and latencies."""

    def __init__(
        self, capacity_s: int = DEFAULT_CAPACITY_S, clock: Callable[[], float] = time.time
    ) -> None:
        self._capacity = capacity_s
        self._clock = clock
        self._ring: list[_Second | None] = [None] * capacity_s
        self._rng = random.Random(0)

    def observe(self, seconds: float, failed: bool) -> None:
        """Record one finished request (now)."""
        now = int(self._clock())
        slot = now % self._capacity
        bucket = self._ring[slot]
        if bucket is None or bucket.second != now:
            bucket = self._ring[slot] = _Second(now)
        bucket.add(seconds, failed, self._rng)

    def points(self, last_s: int | None = None) -> list[dict[str, Any]]:
        """One point per second, oldest first, up to (not including) the current second."""
        span = min(self._capacity - 1, last_s or self._capacity - 1)
        now = int(self._clock())
        return [self._point(second) for second in range(now - span, now)]

    def _point(self, second: int) -> dict[str, Any]:
        bucket = self._ring[second % self._capacity]
        if bucket is None or bucket.second != second:
            return {"t": second, "requests": 0, "errors": 0, "p50_ms": None, "p99_ms": None}
        ordered = sorted(bucket.latencies_s)
        return {
            "t": second,
            "requests": bucket.requests,
            "errors": bucket.errors,
            "p50_ms": round(percentile(ordered, 50) * 1000.0, 3),
            "p99_ms": round(percentile(ordered, 99) * 1000.0, 3),
        }
