"""Running one fault under steady load: readiness monitor, load, fault, recovery wait.

Time to detect = fault -> the first failed request or the first non-200 readiness poll.
Time to recover = fault -> the first success of a request sent after the last failure
or unready poll, with readiness 200 again (and staying so for ``stable_s``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

from shardserve.ops.chaos.ledger import Ledger
from shardserve.ops.chaos.load import LoadGenerator, LoadSpec
from shardserve.ops.chaos.report import ScenarioReport
from shardserve.ops.chaos.target import ChaosMesh

POLL_S = 0.1
READY_WITHIN_S = 180.0  # a fresh mesh answers its first request within this


@dataclass(frozen=True)
class Pace:
    """How long each phase lasts; ``quick`` shortens everything."""

    clients: int = 4
    warmup_s: float = 2.0
    recover_within_s: float = 60.0
    stable_s: float = 1.0
    after_s: float = 2.0
    hold_s: float = 6.0  # SIGSTOP length, broker outage
    flood_s: float = 6.0
    flood_max: int = 1200
    timeout_s: float = 5.0
    grace_s: float = 5.0


QUICK = Pace(
    clients=3,
    warmup_s=1.0,
    recover_within_s=45.0,
    after_s=1.0,
    hold_s=4.5,
    flood_s=3.0,
    flood_max=400,
)
FULL = Pace()


@dataclass
class ReadinessMonitor:
    """Polls ``/v2/health/ready``; keeps (time, status) of every poll (0 = no answer)."""

    url: str
    polls: list[tuple[float, int]] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        timeout = aiohttp.ClientTimeout(total=1.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not stop.is_set():
                self.polls.append((time.monotonic(), await self._poll(session)))
                await asyncio.sleep(POLL_S)

    async def _poll(self, session: aiohttp.ClientSession) -> int:
        try:
            async with session.get(self.url + "/v2/health/ready") as resp:
                await resp.read()
                return resp.status
        except (aiohttp.ClientError, TimeoutError, ConnectionError):
            return 0

    def first_unready_after(self, t: float) -> float | None:
        return next((at for at, status in self.polls if at >= t and status != 200), None)

    def last_unready_after(self, t: float) -> float | None:
        return max((at for at, status in self.polls if at >= t and status != 200), default=None)

    @property
    def ready_now(self) -> bool:
        return bool(self.polls) and self.polls[-1][1] == 200


@dataclass
class Context:
    mesh: ChaosMesh
    pace: Pace

    def load_spec(self) -> LoadSpec:
        return LoadSpec(
            self.mesh.http_url, timeout_s=self.pace.timeout_s, grace_s=self.pace.grace_s
        )


Fault = Callable[[ScenarioReport], Awaitable[None]]


def _last_bad(ledger: Ledger, monitor: ReadinessMonitor, t0: float) -> float:
    failures = [o.done_at for o in ledger.outcomes.values() if o.kind != "ok" and o.done_at >= t0]
    return max([t0, *failures, monitor.last_unready_after(t0) or t0])


async def wait_recovered(
    ledger: Ledger, monitor: ReadinessMonitor, t0: float, pace: Pace
) -> float | None:
    """Seconds from the fault to recovery, or None if it did not recover in time."""
    end = t0 + pace.recover_within_s
    while time.monotonic() < end:
        await asyncio.sleep(0.2)
        last_bad = _last_bad(ledger, monitor, t0)
        ok_at = ledger.first_ok_sent_after(last_bad)
        if ok_at is not None and monitor.ready_now and time.monotonic() - last_bad >= pace.stable_s:
            return ok_at - t0
    return None


async def under_load(
    ctx: Context, name: str, fault: Fault, *, expect_effect: bool = True
) -> ScenarioReport:
    """Run ``fault`` while K clients load the mesh; the report of every request."""
    ledger = Ledger()
    generator = LoadGenerator(ctx.load_spec(), ledger)
    monitor = ReadinessMonitor(ctx.mesh.http_url)
    stop_load, stop_monitor = asyncio.Event(), asyncio.Event()
    report = ScenarioReport(name=name)
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(monitor.run(stop_monitor))
        tasks.create_task(generator.closed_loop(ctx.pace.clients, stop_load))
        await asyncio.sleep(ctx.pace.warmup_s)
        t0 = time.monotonic()
        try:
            await fault(report)
            recover = await wait_recovered(ledger, monitor, t0, ctx.pace)
            await asyncio.sleep(ctx.pace.after_s)
        finally:
            # Clients end once their last request has its outcome (bounded by its
            # deadline + grace); the task group waits for them.
            stop_load.set()
            stop_monitor.set()
    return _finish(report, ledger, monitor, t0, recover, expect_effect)


def _finish(
    report: ScenarioReport,
    ledger: Ledger,
    monitor: ReadinessMonitor,
    t0: float,
    recover: float | None,
    expect_effect: bool,
) -> ScenarioReport:
    counted = ScenarioReport.from_ledger(report.name, ledger)
    for name in (
        "sent",
        "succeeded",
        "wrong",
        "failed",
        "hung",
        "lost",
        "duplicated",
        "unexpected",
    ):
        setattr(report, name, getattr(counted, name))
    detections = [t for t in (ledger.first_failure_after(t0), monitor.first_unready_after(t0)) if t]
    report.detect_s = (min(detections) - t0) if detections else None
    report.recover_s = recover
    report.recovered = recover is not None
    if expect_effect and report.detect_s is None:
        report.notes.append("the fault was never visible to clients or readiness")
    return report


async def wait_healthy(mesh: ChaosMesh, within_s: float) -> bool:
    """Readiness 200 and one correct answer, within ``within_s``."""
    ledger = Ledger()
    generator = LoadGenerator(LoadSpec(mesh.http_url), ledger)
    end = time.monotonic() + within_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < end and mesh.running:
            await generator.one(session)
            if ledger.count("ok"):
                return True
            await asyncio.sleep(0.25)
    return False
