"""The scenarios: one fault each, injected into a loaded mesh (see ``driver``).

Each function takes the context and returns its ScenarioReport; problems found beyond
the ledger (a consumer that did not come back, a probe answered 5xx, RSS growth) are
added to ``report.problems`` and fail the scenario.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from shardserve.ops.chaos import amqp_faults, http_faults, names, private_broker
from shardserve.ops.chaos.driver import READY_WITHIN_S, Context, under_load, wait_healthy
from shardserve.ops.chaos.ledger import Ledger
from shardserve.ops.chaos.load import LoadGenerator
from shardserve.ops.chaos.report import ScenarioReport
from shardserve.ops.chaos.target import ChaosMesh, rss_bytes
from shardserve.wire import topology

SERVABLE, VERSION = "matmul", 1
VICTIM_RANK = 1


def _signal(pid: int, sig: signal.Signals) -> None:
    os.kill(pid, sig)


def work_queues(ctx: Context) -> list[str]:
    return [topology.agent_work_queue(SERVABLE, VERSION, r).name for r in range(ctx.mesh.ranks)]


async def check_consumers(ctx: Context, report: ScenarioReport) -> None:
    """The request queue and every rank's work queue must have a consumer again."""
    queues = [topology.REQUEST_QUEUE, *work_queues(ctx)]
    counts: dict[str, int] = {}
    for _ in range(50):
        counts = await amqp_faults.consumer_counts(ctx.mesh.amqp_url, queues)
        if all(c >= 1 for c in counts.values()):
            break
        await asyncio.sleep(0.2)
    report.extra["consumers"] = counts
    for name, count in counts.items():
        if count < 1:
            report.problems.append(f"queue {name} has no consumer after the fault ({count})")


async def agent_kill(ctx: Context) -> ScenarioReport:
    async def fault(report: ScenarioReport) -> None:
        pid = ctx.mesh.agent_pid(VICTIM_RANK)
        _signal(pid, signal.SIGKILL)
        report.notes.append(f"SIGKILL agent rank {VICTIM_RANK} (pid {pid})")

    report = await under_load(ctx, "agent-kill", fault)
    await check_consumers(ctx, report)
    return report


async def agent_stop(ctx: Context) -> ScenarioReport:
    async def fault(report: ScenarioReport) -> None:
        pid = ctx.mesh.agent_pid(VICTIM_RANK)
        _signal(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(ctx.pace.hold_s)
        finally:
            _signal(pid, signal.SIGCONT)
        report.notes.append(f"SIGSTOP agent rank {VICTIM_RANK} (pid {pid}) {ctx.pace.hold_s:g}s")

    report = await under_load(ctx, "agent-stop", fault)
    await check_consumers(ctx, report)
    return report


async def scheduler_kill(ctx: Context) -> ScenarioReport:
    async def fault(report: ScenarioReport) -> None:
        pid = ctx.mesh.service_pid("scheduler")
        _signal(pid, signal.SIGKILL)
        report.notes.append(f"SIGKILL scheduler (pid {pid}); the launcher restarts it")

    report = await under_load(ctx, "scheduler-kill", fault)
    await check_consumers(ctx, report)
    return report


async def gateway_term(ctx: Context) -> ScenarioReport:
    async def fault(report: ScenarioReport) -> None:
        pid = ctx.mesh.service_pid("gateway")
        _signal(pid, signal.SIGTERM)
        report.notes.append(f"SIGTERM gateway (pid {pid}) mid-load; the launcher restarts it")

    return await under_load(ctx, "gateway-term", fault)


async def broker_restart(ctx: Context) -> ScenarioReport:
    """Restart the broker (stop_app, hold, start_app) under load, on a private RabbitMQ
    node with a mesh of its own: the shared broker is never stopped."""
    try:
        node = await asyncio.to_thread(private_broker.start_node, ctx.mesh.workdir / "rabbit")
    except private_broker.NoPrivateBroker as exc:
        return ScenarioReport("broker-restart", skipped=f"no private RabbitMQ node: {exc}")
    mesh = ChaosMesh(
        ctx.mesh.workdir / "broker-restart",
        ranks=ctx.mesh.ranks,
        base_amqp_url=node.url(),
        own_vhost=False,
    )
    try:
        await asyncio.to_thread(mesh.start)
        return await _restart_under_load(Context(mesh, ctx.pace), node)
    finally:
        await asyncio.to_thread(mesh.stop)
        await asyncio.to_thread(node.stop)


async def _restart_under_load(ctx: Context, node: Any) -> ScenarioReport:
    if not await wait_healthy(ctx.mesh, READY_WITHIN_S):
        return ScenarioReport(
            "broker-restart", recovered=False, problems=["private mesh never became ready"]
        )

    async def fault(report: ScenarioReport) -> None:
        # rabbitmqctl takes seconds: off the event loop, so load and readiness polls go on
        await asyncio.to_thread(node.ctl, "stop_app")
        try:
            await asyncio.sleep(ctx.pace.hold_s)
        finally:
            await asyncio.to_thread(node.ctl, "start_app")
        report.notes.append(
            f"private broker {node.nodename}: stop_app for {ctx.pace.hold_s:g}s, then start_app"
        )

    report = await under_load(ctx, "broker-restart", fault)
    await check_consumers(ctx, report)
    return report


async def malformed_amqp(ctx: Context) -> ScenarioReport:
    async def fault(report: ScenarioReport) -> None:
        work = work_queues(ctx)[0]
        injection = await amqp_faults.inject(ctx.mesh.amqp_url, work)
        await amqp_faults.collect_dead_letters(ctx.mesh.amqp_url, injection, within_s=15)
        report.extra["injected"] = len(injection.sent)
        report.extra["dead_lettered"] = len(injection.dead_lettered)
        report.notes.append(
            f"{len(injection.sent)} malformed messages into {topology.REQUEST_QUEUE} and {work}; "
            f"{len(injection.dead_lettered)} dead-lettered"
        )
        if injection.missing:
            report.problems.append(f"not dead-lettered: {', '.join(injection.missing)}")

    report = await under_load(ctx, "malformed-amqp", fault, expect_effect=False)
    await check_consumers(ctx, report)
    _no_failures_expected(report)
    return report


async def bad_http(ctx: Context) -> ScenarioReport:
    async def fault(report: ScenarioReport) -> None:
        rss_before = rss_bytes(ctx.mesh.service_pid("gateway"))
        results = await http_faults.run_probes(ctx.mesh.http_url, ctx.mesh.http_port)
        rss_after = rss_bytes(ctx.mesh.service_pid("gateway"))
        report.extra["probes"] = {r.name: [r.status, round(r.elapsed_s, 3)] for r in results}
        report.extra["gateway_rss_mb"] = [round(rss_before / 2**20, 1), round(rss_after / 2**20, 1)]
        for r in results:
            if not r.ok:
                report.problems.append(
                    f"probe {r.name} answered {r.status} ({r.note or 'not 4xx'})"
                )
        statuses = ", ".join(f"{r.name}={r.status}" for r in results)
        report.notes.append(f"probes: {statuses}")

    report = await under_load(ctx, "bad-http", fault, expect_effect=False)
    _no_failures_expected(report)
    return report


def _no_failures_expected(report: ScenarioReport) -> None:
    """Faults that must not disturb well-formed traffic at all."""
    if report.failed:
        report.problems.append(f"well-formed requests failed during the fault: {report.failed}")


# ---------------------------------------------------------------- flood and drain


async def measure_capacity(ctx: Context, seconds: float = 3.0) -> float:
    """Requests per second the mesh completes with K closed-loop clients."""
    ledger = Ledger()
    stop = asyncio.Event()
    generator = LoadGenerator(ctx.load_spec(), ledger)
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(generator.closed_loop(ctx.pace.clients * 2, stop))
        await asyncio.sleep(seconds)
        stop.set()
    return max(1.0, ledger.count("ok") / seconds)


async def flood(ctx: Context) -> ScenarioReport:
    capacity = await measure_capacity(ctx)
    rate = 10 * capacity
    total = min(ctx.pace.flood_max, int(rate * ctx.pace.flood_s))
    ledger = Ledger()
    generator = LoadGenerator(ctx.load_spec(), ledger)
    pids = {s: ctx.mesh.service_pid(s) for s in ("gateway", "scheduler")}
    baseline = {s: rss_bytes(p) for s, p in pids.items()}
    peak = dict(baseline)
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            for s, p in pids.items():
                peak[s] = max(peak[s], rss_bytes(p))
            await asyncio.sleep(0.2)

    t0 = time.monotonic()
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(sample())
        await generator.open_loop(rate, total)
        done.set()
    report = ScenarioReport.from_ledger("flood", ledger)
    report.detect_s = (ledger.first_failure_after(t0) or t0) - t0 if report.failed else None
    refusals = sorted(
        o.done_at - o.sent_at
        for o in ledger.outcomes.values()
        if o.detail.startswith(("429", "503"))
    )
    report.extra.update(
        capacity_rps=round(capacity, 1),
        rate_rps=round(rate, 1),
        refusal_p99_s=round(refusals[int(len(refusals) * 0.99) - 1], 3) if refusals else None,
        rss_mb={s: [round(baseline[s] / 2**20, 1), round(peak[s] / 2**20, 1)] for s in pids},
    )
    report.notes.append(
        f"open loop: {total} requests at {rate:.0f}/s (10x the measured {capacity:.0f}/s)"
    )
    for s in pids:
        if peak[s] > 1.5 * baseline[s] + 64 * 2**20:
            report.problems.append(f"{s} RSS grew from {baseline[s] >> 20} to {peak[s] >> 20} MiB")
    await _settle(ctx, report)
    return report


async def _settle(ctx: Context, report: ScenarioReport) -> None:
    """After an open-loop burst: one good request again (bounded)."""
    ledger = Ledger()
    generator = LoadGenerator(ctx.load_spec(), ledger)
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as session:
        while time.monotonic() - t0 < ctx.pace.recover_within_s:
            await generator.one(session)
            if ledger.count("ok"):
                report.recover_s = time.monotonic() - t0
                return
            await asyncio.sleep(0.2)
    report.recovered = False


async def drain(ctx: Context) -> ScenarioReport:
    """Stop the whole mesh (SIGTERM to ``shardserve up``) under load; count outcomes."""

    async def fault(report: ScenarioReport) -> None:
        code = await asyncio.to_thread(ctx.mesh.stop, 90.0)
        report.notes.append(f"shardserve up stopped under load, exit code {code}")
        if code != 0:
            report.problems.append(f"shardserve up exited {code} on SIGTERM")

    quick_end = Context(ctx.mesh, dataclasses.replace(ctx.pace, recover_within_s=0.5))
    report = await under_load(quick_end, "drain", fault)
    report.recovered = True  # nothing comes back after a stop; only the ledger counts
    report.recover_s = None
    return report


Scenario = Callable[[Context], Awaitable[ScenarioReport]]

SCENARIOS: dict[str, Scenario] = {
    "bad-http": bad_http,
    "malformed-amqp": malformed_amqp,
    "agent-stop": agent_stop,
    "agent-kill": agent_kill,
    "scheduler-kill": scheduler_kill,
    "gateway-term": gateway_term,
    "flood": flood,
    "broker-restart": broker_restart,
    "drain": drain,
}
assert tuple(SCENARIOS) == names.ALL
