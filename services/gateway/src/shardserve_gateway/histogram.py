"""A Prometheus histogram: counts per bucket bound (the last one +Inf) and the sum; the
one class the request latency and the generation token metrics both use."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from shardserve_gateway.mesh_metrics import labels

# The 1-2.5-5 series of bucket bounds, in seconds, from 1 ms to 30 s; each histogram takes
# the span it needs (``seconds_buckets``) so the gateway's histograms line up bound for bound.
SECONDS_SERIES: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


def seconds_buckets(low: float, high: float) -> tuple[float, ...]:
    """The bounds of ``SECONDS_SERIES`` from ``low`` to ``high``, both included."""
    return tuple(bound for bound in SECONDS_SERIES if low <= bound <= high)


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total += seconds

    def render(self, name: str, **label_values: str) -> list[str]:
        """The ``_bucket``, ``_sum`` and ``_count`` lines of one labelled series."""
        lines, cumulative = [], 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            cumulative += count
            lines.append(f"{name}_bucket{labels(**label_values, le=f'{bound:g}')} {cumulative}")
        cumulative += self.counts[-1]
        lines.append(f"{name}_bucket{labels(**label_values, le='+Inf')} {cumulative}")
        lines.append(f"{name}_sum{labels(**label_values)} {self.total:.6f}")
        lines.append(f"{name}_count{labels(**label_values)} {cumulative}")
        return lines
