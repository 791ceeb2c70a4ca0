"""The closed-loop load generator: N workers, each sends its next request when the last
one is answered, for a fixed duration after a warm-up that is not counted.

Every HTTP target (floor, mesh) is measured with the same client (``http_client``: one
keep-alive connection per worker, a request prepared once), and the broker limit with the
same loop, so the figures differ only by what is behind them.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.http_client import PostClient

# One call = one request; returns True when the answer was a success.
Call = Callable[[], Awaitable[bool]]


@dataclass(frozen=True)
class LoadSpec:
    """How long to load, and how many workers in parallel."""

    concurrency: int
    duration_s: float
    warmup_s: float
    max_requests: int | None = None  # stop early after this many measured requests


@dataclass
class LoadResult:
    """What one load run measured (latencies of successful measured requests, in ms)."""

    concurrency: int
    requests: int
    errors: int
    elapsed_s: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    first_error: str = ""
    calls_total: int = 0  # every completed call, warm-up included (for CPU accounting)
    latencies_ms: list[float] = field(default_factory=list, repr=False)

    @property
    def rps(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        del data["latencies_ms"]
        data["rps"] = round(self.rps, 2)
        for key in ("p50_ms", "p99_ms", "mean_ms", "elapsed_s"):
            data[key] = round(data[key], 3)
        return data


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; nan for no values."""
    if not sorted_values:
        return math.nan
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    position = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    weight = position - low
    return float(sorted_values[low] * (1 - weight) + sorted_values[high] * weight)


def summarize(
    concurrency: int, latencies_ms: list[float], errors: int, elapsed_s: float, first_error: str
) -> LoadResult:
    ordered = sorted(latencies_ms)
    mean = sum(ordered) / len(ordered) if ordered else math.nan
    return LoadResult(
        concurrency=concurrency,
        requests=len(ordered),
        errors=errors,
        elapsed_s=elapsed_s,
        p50_ms=percentile(ordered, 50),
        p99_ms=percentile(ordered, 99),
        mean_ms=mean,
        first_error=first_error,
        latencies_ms=ordered,
    )


class _Recorder:
    """Shared by the workers: counts only what completes inside the measured window."""

    def __init__(self, spec: LoadSpec, clock: Callable[[], float]) -> None:
        self.spec = spec
        self.clock = clock
        self.start = clock()
        self.measure_from = self.start + spec.warmup_s
        self.stop_at = self.measure_from + spec.duration_s
        self.latencies_ms: list[float] = []
        self.calls_total = 0
        self.errors = 0
        self.first_error = ""
        self.last_end = self.measure_from

    def running(self) -> bool:
        if self.spec.max_requests is not None and len(self.latencies_ms) >= self.spec.max_requests:
            return False
        return self.clock() < self.stop_at

    def record(self, began: float, ended: float, ok: bool, error: str = "") -> None:
        self.calls_total += 1
        if ok and began < self.measure_from:
            return  # warm-up (a failure that ends inside the window still counts)
        if ended < self.measure_from:
            return
        self.last_end = max(self.last_end, ended)
        if ok:
            self.latencies_ms.append((ended - began) * 1000.0)
            return
        self.errors += 1
        if not self.first_error:
            self.first_error = error or "request failed"


async def _worker(call: Call, recorder: _Recorder) -> None:
    while recorder.running():
        began = recorder.clock()
        try:
            ok, error = await call(), ""
        except Exception as exc:  # a failed request is a measured outcome, not a crash
            ok, error = False, f"{type(exc).__name__}: {exc}"
        recorder.record(began, recorder.clock(), ok, error)


async def run_load(
    call: Call, spec: LoadSpec, clock: Callable[[], float] = time.perf_counter
) -> LoadResult:
    """Drive ``call`` from ``spec.concurrency`` workers; measure after the warm-up."""
    recorder = _Recorder(spec, clock)
    async with asyncio.TaskGroup() as tasks:
        for _ in range(spec.concurrency):
            tasks.create_task(_worker(call, recorder))
    elapsed = max(recorder.last_end - recorder.measure_from, 1e-9)
    result = summarize(
        spec.concurrency, recorder.latencies_ms, recorder.errors, elapsed, recorder.first_error
    )
    result.calls_total = recorder.calls_total
    return result


async def load_http(url: str, body: bytes, headers: dict[str, str], spec: LoadSpec) -> LoadResult:
    """Closed-loop HTTP load against one URL with one fixed body (success = HTTP 200)."""
    client = PostClient(url, body, headers)
    try:
        return await run_load(client.call(), spec)
    finally:
        await client.close()
