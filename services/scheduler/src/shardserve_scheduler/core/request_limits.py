"""The request machine's limits, fixed at start: jobs in flight and waiting per servable
version, the batch size and delay, and the queue the ranks send their results to."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestLimits:
    result_to: str
    max_inflight: int
    max_queued: int
    max_batch_size: int
    batch_delay: float

    @classmethod
    def of(
        cls,
        *,
        result_to: str,
        max_inflight: int,
        queue_factor: int,
        max_batch_size: int,
        batch_delay: float,
    ) -> RequestLimits:
        """Limits from the settings: at least one job in flight and one instance per batch;
        ``queue_factor`` jobs may wait per job in flight."""
        inflight = max(1, max_inflight)
        return cls(
            result_to=result_to,
            max_inflight=inflight,
            max_queued=queue_factor * inflight,
            max_batch_size=max(1, max_batch_size),
            batch_delay=max(0.0, batch_delay),
        )
