"""The scheduler process: the pure core's parts and the shell's, wired; its lifecycle.

The core (``core``: the registry, the request machine, the generation machine) takes
events and the time and answers with actions. The shell's parts each own their state and
their task: ``RequestConsumer`` consumes the request queue into ``RequestIntake``;
``ControlPlane`` the control queue (registration, heartbeats, repository commands);
``Machines`` routes events to the machines and their actions to the *sender*
(``ActionSender``: every StageWork leaves from one channel, in order); the *ticker*
drives heartbeat timeouts, deadlines and batch delays; ``ReadinessLog`` announces groups
turning ready or not; ``StatusBroadcast`` sends MeshStatus; ``RepositoryChanges``
rescans the repository; ``Leadership`` decides whether this scheduler is the active one;
``PythonRuns`` runs Python stages in a thread pool. One TaskGroup owns every task.

SIGTERM: stop consuming requests, let open requests finish (bounded by --drain-seconds),
reply UNAVAILABLE "scheduler shutting down" to the rest, then tear down in reverse order.

Active and standby: several schedulers may run; the one holding the leadership token is
active: it says SchedulerHello (agents re-register with it), consumes the request queue
(itself single-active-consumer, as a guard), answers agent hellos and broadcasts
MeshStatus. A standby consumes its own control queue too, so it learns every agent from
hellos and heartbeats, but stays silent. When the active one dies the broker gives the
token to a standby, which takes over (requests in flight with the dead one are failed by
the gateways, which see a new scheduler id). A scheduler whose broker connection drops
steps down at once (its open requests fail with a clear error: their results can no
longer come back) and, when the connection is restored, takes the token back through
the same path (the restored token consumer gets the requeued token): a broker restart
heals without a process restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

from shardserve.amqp.broker import Broker
from shardserve.wire import topology
from shardserve_scheduler.control_plane import ControlPlane
from shardserve_scheduler.core.catalog import Catalog, load_catalog, log_catalog
from shardserve_scheduler.core.generation.machine import GenerationMachine
from shardserve_scheduler.core.generation.state import Limits
from shardserve_scheduler.core.generation.texts import TextModels
from shardserve_scheduler.core.registry import Registry
from shardserve_scheduler.core.requests import RequestMachine
from shardserve_scheduler.intake import SHUTDOWN_MESSAGE, RequestIntake
from shardserve_scheduler.leadership import Leadership
from shardserve_scheduler.machines import Machines
from shardserve_scheduler.python_runs import PythonRuns
from shardserve_scheduler.readiness import ReadinessLog
from shardserve_scheduler.repository_changes import RepositoryChanges
from shardserve_scheduler.request_consumer import RequestConsumer
from shardserve_scheduler.sender import ActionSender, SendVerdict
from shardserve_scheduler.settings import SchedulerSettings
from shardserve_scheduler.status_broadcast import StatusBroadcast
from shardserve_scheduler.ticker import Ticker

_logger = logging.getLogger(__name__)

CONTROL_PREFETCH = 256
RESULT_PREFETCH = 1024


class SchedulerService:
    """One scheduler process: the core's parts and the shell's, behind one broker connection."""

    def __init__(self, settings: SchedulerSettings, clock: Callable[[], float] = time.time):
        self.settings = settings
        self.clock = clock
        self.catalog: Catalog = load_catalog(settings.repository)
        self.registry = Registry.build(
            self.catalog.groups(),
            clock(),
            heartbeat_timeout=settings.heartbeat_timeout,
            wait_agents_seconds=float(settings.wait_agents_seconds),
        )
        self.texts = TextModels(settings.repository)
        self.broker = Broker(settings.broker, f"scheduler-{settings.scheduler_id}")
        self.leadership = Leadership(
            self.broker,
            settings.scheduler_id,
            self._become_active,
            self._step_down,
            renew_every=settings.leader_renew_seconds,
        )
        self._wire_machines()
        self._wire_requests()
        self._wire_status()
        self._wire_agents_and_time()

    def _wire_machines(self) -> None:
        """The two request machines, the sender their actions leave by, Python runs."""
        self.machines = Machines(
            _request_machine(self.settings),
            _generation_machine(self.settings, self.registry),
            put=lambda action: self.sender.put(action),  # the sender, made next, needs them
            clock=self.clock,
        )
        self.python_runs = PythonRuns(self.settings.python_workers, self.machines)
        self.sender = ActionSender(
            self.broker,
            publish_failed=self.machines.on_publish_failed,
            stream_gone=self.machines.on_stream_gone,
            start_python=self.python_runs.start,
            is_active=lambda: self.active,
        )

    def _wire_requests(self) -> None:
        """What the request queue brings, admitted into the machines."""
        self.intake = RequestIntake(
            self.catalog,
            self.registry,
            self.texts,
            self.machines.inference,
            self.machines.generation,
            clock=self.clock,
            emit=self.machines.emit,
        )
        kind = self.settings.request_queue
        self.request_consumer = RequestConsumer(
            self.broker, kind, self.intake, self.machines, self.sender
        )

    def _wire_status(self) -> None:
        """What the mesh is told, the repository's changes, the groups' readiness."""
        settings = self.settings
        self.status = StatusBroadcast(
            settings.scheduler_id,
            self.broker,
            self.catalog,
            self.registry,
            self.machines,
            request_queue=self.request_consumer.queue,
            interval_s=settings.status_interval,
            is_active=lambda: self.active,
            counted_dead=lambda: self.request_consumer.dead_lettered,
            clock=self.clock,
        )
        self.changes = RepositoryChanges(
            settings.repository,
            self.catalog,
            self.registry,
            self.machines.inference,
            changed=self.status.changed,
            send_verdict=lambda verdict: self.sender.put(SendVerdict(verdict)),
            generation=self.machines.generation,
            texts=self.texts,
        )
        self.readiness = ReadinessLog(self.registry, changed=self.status.changed)

    def _wire_agents_and_time(self) -> None:
        """The control plane (agents, repository commands) and the ticker."""
        self.ticker = Ticker(
            self.registry,
            self.machines,
            self.changes,
            self.readiness,
            status_changed=self.status.changed,
            clock=self.clock,
        )
        self.control = ControlPlane(
            self.settings.scheduler_id,
            self.broker,
            self.registry,
            self.machines,
            self.changes,
            self.readiness,
            is_active=lambda: self.active,
            clock=self.clock,
        )

    @property
    def active(self) -> bool:
        return self.leadership.active

    # ------------------------------------------------------------------ lifecycle

    async def run(self, stop: asyncio.Event) -> None:
        log_catalog(self.catalog)
        try:
            # Waits for the broker (a scheduler may start first); a SIGTERM meanwhile stops.
            if not await self.broker.connect_unless_stopped(stop):
                return
            await self._declare()
            async with asyncio.TaskGroup() as tasks:
                self.python_runs.bind(tasks)
                await self._serve(tasks, stop)
        finally:
            self.python_runs.bind(None)
            self.python_runs.shutdown()
            await self.broker.close()
        _logger.info("scheduler stopped")

    async def _serve(self, tasks: asyncio.TaskGroup, stop: asyncio.Event) -> None:
        """Start every task, serve until ``stop``, then drain and end them in reverse order."""
        sender = tasks.create_task(self.sender.run(), name="sender")
        ticker = tasks.create_task(self.ticker.run(), name="ticker")
        status = tasks.create_task(self.status.run(), name="status")
        poll = self.changes.poll(self.settings.repository_poll_seconds)
        poller = tasks.create_task(poll, name="poller")
        await self._start_consuming()
        leader = tasks.create_task(self.leadership.run(), name="leadership")
        _logger.info(
            "scheduler %s started; standby until it holds the leadership token",
            self.settings.scheduler_id,
        )
        await stop.wait()
        self.leadership.closing = True
        leader.cancel()
        await self._drain()
        self.sender.close()  # the sender finishes what is queued, then ends
        await sender
        for task in (poller, status, ticker):
            task.cancel()
        self.python_runs.cancel()

    async def _declare(self) -> None:
        me = self.settings.scheduler_id
        kind = self.settings.request_queue
        bindings = topology.scheduler_bindings(me, kind)
        await self.broker.declare(topology.dead_letter_queue(), bindings)
        await self.broker.declare(topology.request_queue(kind), bindings)
        await self.broker.declare(topology.scheduler_control_queue(me), bindings)
        await self.broker.declare(topology.scheduler_result_queue(me), bindings)

    async def _start_consuming(self) -> None:
        me = self.settings.scheduler_id
        # No acks on results: the queue is exclusive, it dies with this scheduler.
        await self.broker.consume(
            topology.scheduler_result_queue(me).name,
            self.machines.on_result,
            prefetch=RESULT_PREFETCH,
            no_ack=True,
        )
        await self.broker.consume(
            topology.scheduler_control_queue(me).name,
            self.control.on_control,
            prefetch=CONTROL_PREFETCH,
        )
        await self.leadership.start()

    async def _drain(self) -> None:
        """Stop taking requests; give open ones --drain-seconds; refuse the rest."""
        await self.request_consumer.stop()
        _logger.info(
            "draining: %d request(s) open, waiting up to %g s",
            self.machines.inference.open_requests,
            self.settings.drain_seconds,
        )
        await self.machines.wait_idle(self.settings.drain_seconds)
        self.intake.closing = True
        self.python_runs.closing = True
        self.machines.fail_open(SHUTDOWN_MESSAGE, SHUTDOWN_MESSAGE)

    # ------------------------------------------------------------------ leadership

    async def _become_active(self) -> None:
        """Called by the leadership loop once this scheduler holds the token."""
        await self.control.say_hello()
        await self.request_consumer.start()
        self.status.changed()

    def _step_down(self, why: str) -> None:
        """Called by the leadership loop: this scheduler is no longer the active one."""
        _logger.warning("%s: stepping down; failing open requests", why)
        self.machines.fail_open(
            f"{why}; request outcome unknown, retry", f"{why}; generation stopped, retry"
        )
        self.request_consumer.stop_after_replies()


def _request_machine(settings: SchedulerSettings) -> RequestMachine:
    return RequestMachine(
        result_to=topology.scheduler_result_queue(settings.scheduler_id).name,
        id_prefix=uuid.uuid4().hex[:8],
        max_inflight=settings.max_inflight,
        max_batch_size=settings.max_batch_size,
        batch_delay=settings.max_batch_delay_ms / 1000.0,
    )


def _generation_machine(settings: SchedulerSettings, registry: Registry) -> GenerationMachine:
    limits = Limits(
        max_running=settings.max_running_sequences,
        max_waiting=settings.max_waiting_sequences,
        max_prefill_tokens=settings.max_prefill_tokens,
        step_timeout=settings.step_timeout_seconds,
        max_decode_steps=settings.max_decode_steps,
        decode_run_ms=settings.decode_run_ms,
    )
    return GenerationMachine(
        registry,
        result_to=topology.scheduler_result_queue(settings.scheduler_id).name,
        id_prefix=uuid.uuid4().hex[:8],
        limits=limits,
    )
