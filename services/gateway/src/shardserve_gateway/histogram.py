"""A Prometheus histogram: counts per bucket bound (the last one +Inf) and the sum; the
one class the request latency and the generation token metrics both use."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from shardserve_gateway.mesh_metrics import labels


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
