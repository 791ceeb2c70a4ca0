"""vLLM ``benchmark_serving``'s metrics from streamed chunk timestamps, and its arrivals.

Definitions (reference generation.md section 5, as vLLM computes them):

- TTFT: from sending the request to the first chunk that carries text;
- ITL: every gap between consecutive text-carrying chunks (a chunk that carries several
  tokens is one gap, as in vLLM);
- TPOT: per request, (E2EL - TTFT) / (output tokens - 1), for requests of more than one token;
- E2EL: from sending to the last byte of the stream;
- throughput: completed requests, output tokens and prompt + output tokens per second of the
  whole measured wall time (first send to last completion).

Pure functions: the streaming client (``gen_client``) records ``Trace``s, this turns them
into figures, and ``poisson_offsets`` gives the send times of a Poisson arrival process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Trace:
    """One request as the client saw it; times in seconds on one monotonic clock."""

    sent: float
    prompt_tokens: int
    chunk_times: list[float] = field(default_factory=list)  # text-carrying chunks only
    done: float = math.nan
    output_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.chunk_times) and not math.isnan(self.done)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def e2el(self) -> float:
        return self.done - self.sent

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def stats_ms(values_s: Sequence[float]) -> dict[str, float]:
    """Mean, median and p99 in milliseconds (nan for no values)."""
    if not values_s:
        return {"mean": math.nan, "median": math.nan, "p99": math.nan}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {
        "mean": round(float(ms.mean()), 3),
        "median": round(float(np.median(ms)), 3),
        "p99": round(float(np.percentile(ms, 99)), 3),
    }


def summarize_traces(traces: Sequence[Trace]) -> dict[str, Any]:
    """vLLM's figures for one measured load (warm-up traces already left out)."""
    done = [t for t in traces if t.ok]
    failed = [t for t in traces if not t.ok]
    wall = _wall_s(done)
    output = sum(t.output_tokens for t in done)
    prompt = sum(t.prompt_tokens for t in done)
    tpots = [tp for t in done if (tp := t.tpot) is not None]
    return {
        "completed": len(done),
        "failed": len(failed),
        "first_error": failed[0].error[:300] if failed else "",
        "duration_s": round(wall, 3),
        "request_throughput": _per_s(len(done), wall),
        "output_throughput": _per_s(output, wall),
        "total_token_throughput": _per_s(prompt + output, wall),
        "output_tokens": output,
        "prompt_tokens": prompt,
        "ttft_ms": stats_ms([t.ttft for t in done]),
        "tpot_ms": stats_ms(tpots),
        "itl_ms": stats_ms([gap for t in done for gap in t.itls]),
        "e2el_ms": stats_ms([t.e2el for t in done]),
    }


def _wall_s(done: Sequence[Trace]) -> float:
    if not done:
        return 0.0
    return max(t.done for t in done) - min(t.sent for t in done)


def _per_s(count: float, seconds: float) -> float:
    return round(count / seconds, 3) if seconds > 0 else 0.0


def poisson_offsets(rate: float, count: int, seed: int) -> list[float]:
    """Send times (s after the start) of ``count`` requests arriving as a Poisson process of
    ``rate`` per second: exponential gaps, the first request at its first gap, as vLLM's
    ``get_request`` (burstiness 1). ``rate`` inf: every request at 0."""
    if count <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * count
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count)
    return [float(v) for v in np.cumsum(gaps)]
