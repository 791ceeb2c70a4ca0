"""``shardserve up``: one command that runs a whole mesh on this machine, supervised.

It checks the broker, exports the demo repository on first use (when no repository is
given), then starts the scheduler, the gateway and one agent per rank of every servable
version, each as ``python -m shardserve_<svc> ...`` in its own process group (see
``shardserve.process.supervise``), restarting any that dies. While agents load, it polls the
gateway's ``/api/status`` and prints readiness as it changes. While it runs, it watches
the repository (``shardserve.ops.launch.watch``): a version folder added later gets its
agents, one removed (or unloaded by the scheduler) loses them, the others are untouched.

Stop order (Ctrl-C / SIGTERM) follows the request flow, upstream first, so that nothing
in flight is lost: the **gateway** first (it stops taking HTTP requests and waits for the
replies of those it accepted, which needs the scheduler and agents still running), then
the **scheduler** (it takes no new requests and finishes its in-flight jobs, which needs
the agents), then the **agents** (their queues are empty by then; they say bye and leave).
Each tier gets SIGTERM, ``grace_seconds`` to exit, then SIGKILL. A second Ctrl-C kills
everything at once.

A crashed agent is restarted after the plain back-off (1 s first). Its successor may find
the rank still held by the dead instance (until the scheduler's heartbeat timeout); the
scheduler then refuses it with ``retry_after_s`` and the agent asks again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from shardserve.errors import RepositoryError
from shardserve.ops.launch.plan import (
    START_ORDER,
    UpOptions,
    agent_plan,
    discover_groups,
    ensure_demo_repository,
    plan_children,
    repository_version_is_valid,
    with_agent_threads,
)
from shardserve.ops.launch.processes import Mesh
from shardserve.ops.launch.records import UpRecord, live_records, vhost_of
from shardserve.ops.launch.status import (
    StatusBoard,
    StatusUnavailable,
    fetch_status,
    format_status,
    public_url,
    watch_progress,
)
from shardserve.ops.launch.watch import RepositoryWatcher
from shardserve.process.redact import redact_url
from shardserve.process.settings import AMQP_URL_ENV, BrokerSettings
from shardserve.process.supervise import EXIT_USAGE
from shardserve.repo.repository import GroupConfig
from shardserve.wire import topology

if TYPE_CHECKING:
    from aio_pika.abc import AbstractConnection

EXIT_FAILED = 1

__all__ = [
    "LaunchError",
    "StatusUnavailable",
    "UpOptions",
    "check_broker",
    "fetch_status",
    "format_status",
    "repository_version_is_valid",
    "run_up",
    "serve",
]


class LaunchError(Exception):
    """``up`` cannot start; the message says why and what to do."""


# ---------------------------------------------------------------- broker


async def check_broker(settings: BrokerSettings, connect_timeout: float = 5.0) -> None:
    """Open (and close) one AMQP connection, so a wrong host or password shows up now, and
    refuse a vhost where a mesh already runs (its schedulers consume the leadership queue):
    a second one would silently join it as a standby and refuse its own agents."""
    import aio_pika

    failures = []
    for url in settings.urls:
        try:
            connection = await aio_pika.connect(url, timeout=connect_timeout)
        except Exception as exc:  # any failure means "not usable"; we report all of them
            failures.append(f"{redact_url(url)}: {exc or type(exc).__name__}")
            continue
        try:
            schedulers = await _leader_consumers(connection)
        finally:
            await connection.close()
        if schedulers:
            raise LaunchError(_running_mesh_message(vhost_of(url), schedulers))
        return
    raise LaunchError(
        "cannot reach RabbitMQ (" + "; ".join(failures) + "). Start one (scripts/ensure-rabbitmq)"
        f" or point {AMQP_URL_ENV} at a running broker."
    )


async def _leader_consumers(connection: AbstractConnection) -> int:
    """Schedulers consuming the vhost's leadership queue (0 when it does not exist)."""
    from aiormq.exceptions import ChannelNotFoundEntity

    channel = await connection.channel()
    try:
        queue = await channel.declare_queue(topology.SCHEDULER_LEADER_QUEUE, passive=True)
    except ChannelNotFoundEntity:
        return 0
    result = queue.declaration_result
    await channel.close()
    return int(result.consumer_count or 0)


def _running_mesh_message(vhost: str, schedulers: int) -> str:
    running = [r.describe() for r in live_records() if r.vhost == vhost]
    which = f": {'; '.join(running)}" if running else f" ({schedulers} scheduler(s) running)"
    return (
        f"a mesh already runs on the broker's vhost {vhost!r}{which}. Stop it first, or run "
        f"this one on another vhost ({AMQP_URL_ENV}=amqp://HOST:5672/OTHER_VHOST)."
    )


# ---------------------------------------------------------------- run


def _start(mesh: Mesh, repo: Path, groups: list[GroupConfig], options: UpOptions) -> None:
    tiers = plan_children(repo, groups, options)
    for tier in START_ORDER:
        if tier == "agent":
            for group, specs in agent_plan(repo, groups, options):
                mesh.start_group(group, specs)
        else:
            for spec in tiers[tier]:
                mesh.start_core(tier, spec)


async def serve(repo: Path, groups: list[GroupConfig], options: UpOptions) -> int:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    mesh = Mesh(env)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, mesh.on_signal)
    base_url = public_url(options.host, options.http_port)
    board = StatusBoard()
    try:
        async with asyncio.TaskGroup() as tasks:
            mesh.attach(tasks)
            _start(mesh, repo, groups, options)
            record = UpRecord(os.getpid(), base_url, str(repo), _vhost())
            tasks.create_task(_keep_record(record, mesh))
            watchers = [
                tasks.create_task(
                    watch_progress(base_url, mesh.running_groups, options.status_interval, board)
                )
            ]
            if options.repository_poll_seconds > 0:
                watcher = RepositoryWatcher(repo, mesh, options, board)
                watchers.append(tasks.create_task(watcher.run()))
            await mesh.stop_requested.wait()
            for task in watchers:
                task.cancel()
            await mesh.stop(options.grace_seconds)
    finally:
        mesh.kill_all()  # no-op after a clean stop; never leave children behind on a bug
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return EXIT_FAILED if mesh.failed else 0


async def _keep_record(record: UpRecord, mesh: Mesh) -> None:
    """The run record exists until the mesh is asked to stop (status finds the gateway)."""
    with record.kept():
        await mesh.stop_requested.wait()


def _vhost() -> str:
    return vhost_of(BrokerSettings.from_env().urls[0])


def run_up(options: UpOptions) -> int:
    """Entry point of ``shardserve up``; returns the exit code."""
    from shardserve.errors import ExportError

    try:
        repo = options.repository or ensure_demo_repository()
        groups = discover_groups(repo)
    except (RepositoryError, ExportError) as exc:
        print(f"shardserve up: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        asyncio.run(check_broker(BrokerSettings.from_env()))
    except LaunchError as exc:
        print(f"shardserve up: {exc}", file=sys.stderr)
        return EXIT_FAILED
    total = sum(g.rank_size for g in groups)
    options, cores = with_agent_threads(options, total)
    print(
        f"serving {repo}: {len(groups)} servable version(s), {total} agent(s) with "
        f"{options.threads} onnxruntime thread(s) each ({cores} usable cores); "
        f"gateway on {public_url(options.host, options.http_port)}",
        flush=True,
    )
    return asyncio.run(serve(repo.resolve(), groups, options))
