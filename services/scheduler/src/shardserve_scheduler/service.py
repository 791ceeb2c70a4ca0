"""The scheduler's I/O shell: broker messages in, the pure core's actions out.

Tasks (one TaskGroup owns them): the *sender* executes actions in the order the core
produced them (so every StageWork leaves from one channel, in order), the *ticker* drives
heartbeat timeouts, deadlines and batch delays (it wakes early when a batch is due), the
*status* loop broadcasts MeshStatus, the *poller* rescans the repository. Python stages
run in a thread pool (--python-workers); each run is a task of the same TaskGroup that
feeds its outcome back to the core. Consumers (requests, control, results) only call the
core and queue its actions.

Versions come and go while running: a rescan (every --repository-poll-seconds, and on a
RepositoryCommand "load") adds new version folders to the catalog and the registry (their
agents register when started). A RepositoryCommand "unload" (or a version folder removed
from disk) puts the version in state "unloading": explicit requests for it get 503,
version 0 skips it; once its open requests are done it is dropped (then 404), and every
agent still holding one of its ranks gets ``RegistrationVerdict(accepted=False,
reason="unloaded")`` on its control key, so it exits (code 3). An unloaded version comes
back only with a "load" command (a scan does not re-add it).

SIGTERM: stop consuming requests, let open requests finish (bounded by --drain-seconds),
reply UNAVAILABLE "scheduler shutting down" to the rest, then tear down in reverse order.

Active and standby: several schedulers may run; one is active. Every scheduler consumes
the leadership queue (``topology.scheduler_leader_queue``: single-active-consumer,
prefetch 1); the one that receives the token message holds it unacked and is active: it
says SchedulerHello (agents re-register with it), consumes the request queue (itself
single-active-consumer, as a guard), answers agent hellos and broadcasts MeshStatus. A
standby consumes its own control queue too, so it learns every agent from hellos and
heartbeats, but stays silent. When the active one dies its connection closes, the broker
requeues the token to the next consumer, and that scheduler takes over (its requests in
flight are failed by the gateways, which see a new scheduler id). An active scheduler
whose broker connection drops steps down at once (the broker requeued its token; its
open requests fail with a clear error) and is active again only if the token comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from aio_pika.abc import AbstractIncomingMessage

from shardserve import topology
from shardserve.broker import Broker
from shardserve.errors import ErrorCode, InferenceError
from shardserve.lifecycle import request_id_var
from shardserve.protocol import (
    AgentBye,
    AgentHeartbeat,
    AgentHello,
    InferRequest,
    Message,
    RegistrationVerdict,
    RepositoryCommand,
    SchedulerHello,
    StageResult,
)
from shardserve_scheduler import rescan
from shardserve_scheduler.actions import (
    Action,
    Cancel,
    Log,
    PublishStageWork,
    Reply,
    RunPython,
    error_reply,
)
from shardserve_scheduler.catalog import Catalog, GroupKey, load_catalog
from shardserve_scheduler.pystages import run_python_task
from shardserve_scheduler.registry import Registry
from shardserve_scheduler.requests import RequestMachine
from shardserve_scheduler.resolve import resolve
from shardserve_scheduler.settings import SchedulerSettings
from shardserve_scheduler.status import mesh_status

_logger = logging.getLogger(__name__)

TICK_SECONDS = 0.1
REQUEST_PREFETCH = 256
CONTROL_PREFETCH = 256
RESULT_PREFETCH = 1024
SHUTDOWN_MESSAGE = "scheduler shutting down"
UNLOADED_REASON = "unloaded"


@dataclass(frozen=True)
class _CancelConsumer:
    """Stop consuming requests (queued behind the replies of a step-down)."""

    consumer_tag: str


@dataclass(frozen=True)
class _SendVerdict:
    """Tell an agent of an unloaded version to leave."""

    verdict: RegistrationVerdict


_Outgoing = Action | _CancelConsumer | _SendVerdict


class SchedulerService:
    """One scheduler process: registry + request machine behind a broker connection."""

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
        self.machine = RequestMachine(
            result_to=topology.scheduler_result_queue(settings.scheduler_id).name,
            id_prefix=uuid.uuid4().hex[:8],
            max_inflight=settings.max_inflight,
            max_batch_size=settings.max_batch_size,
            batch_delay=settings.max_batch_delay_ms / 1000.0,
        )
        self._pool = ThreadPoolExecutor(settings.python_workers, thread_name_prefix="pystage")
        self._tasks: asyncio.TaskGroup | None = None
        self._python_runs: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()  # a batch became due sooner than the next tick
        self._held_back: set[GroupKey] = set()  # unloaded by command: scans do not re-add
        self.broker = Broker(settings.broker, f"scheduler-{settings.scheduler_id}")
        self.refused_requests = 0
        self.dead_lettered_requests = 0
        self._outbox: asyncio.Queue[_Outgoing | None] = asyncio.Queue()
        self._status_changed = asyncio.Event()
        self._idle = asyncio.Event()  # set while no request is open (for the drain)
        self._idle.set()
        self._readiness = self.registry.readiness()
        self._request_consumer = ""
        self._closing = False
        self.active = False
        self._token: AbstractIncomingMessage | None = None
        self._token_arrived = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle

    async def run(self, stop: asyncio.Event) -> None:
        self._log_catalog()
        await self.broker.connect()
        try:
            await self._declare()
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                sender = tasks.create_task(self._send_loop(), name="sender")
                ticker = tasks.create_task(self._tick_loop(), name="ticker")
                status = tasks.create_task(self._status_loop(), name="status")
                poller = tasks.create_task(self._poll_loop(), name="poller")
                leader = tasks.create_task(self._leadership_loop(), name="leadership")
                await self._start_consuming()
                _logger.info(
                    "scheduler %s started; standby until it holds the leadership token",
                    self.settings.scheduler_id,
                )
                await stop.wait()
                leader.cancel()
                await self._drain()
                self._outbox.put_nowait(None)  # the sender finishes what is queued, then ends
                await sender
                for task in (poller, status, ticker, *self._python_runs):
                    task.cancel()
        finally:
            self._tasks = None
            self._pool.shutdown(wait=False, cancel_futures=True)
            await self.broker.close()
        _logger.info("scheduler stopped")

    async def _declare(self) -> None:
        me = self.settings.scheduler_id
        bindings = topology.scheduler_bindings(me)
        await self.broker.declare(topology.dead_letter_queue(), bindings)
        await self.broker.declare(topology.request_queue(), bindings)
        await self.broker.declare(topology.scheduler_control_queue(me), bindings)
        await self.broker.declare(topology.scheduler_result_queue(me), bindings)
        leader = await self.broker.declare(topology.scheduler_leader_queue())
        result = getattr(leader, "declaration_result", None)
        if result is None or result.message_count == 0:
            # No token waiting: the first scheduler ever, or the token is held by the
            # active one (unacked). An extra token is harmless: only the single active
            # consumer receives tokens, one at a time; so tokens stay few.
            token = SchedulerHello(scheduler=me)
            await self.broker.publish("", topology.SCHEDULER_LEADER_QUEUE, token, confirm=True)

    async def _start_consuming(self) -> None:
        me = self.settings.scheduler_id
        await self.broker.consume(
            topology.scheduler_result_queue(me).name, self._on_result, prefetch=RESULT_PREFETCH
        )
        await self.broker.consume(
            topology.scheduler_control_queue(me).name, self._on_control, prefetch=CONTROL_PREFETCH
        )
        await self.broker.consume_raw(
            topology.SCHEDULER_LEADER_QUEUE, self._on_leader_token, prefetch=1
        )

    # ------------------------------------------------------------------ leadership

    async def _on_leader_token(self, incoming: AbstractIncomingMessage) -> None:
        """Hold the token unacked: the broker gives it to the next scheduler when we die."""
        self._token = incoming
        self._token_arrived.set()

    async def _leadership_loop(self) -> None:
        while True:
            await self._token_arrived.wait()
            self._token_arrived.clear()
            if self._closing:
                continue
            if self.active:
                # We never ack the token, so a new delivery means the channel that held
                # it died (a reconnect): our old leadership ended with it.
                self._step_down("the scheduler's broker channel was replaced")
            while not self.broker.healthy:  # noqa: ASYNC110 - a flag set by aio-pika callbacks
                await asyncio.sleep(TICK_SECONDS / 2)  # (the token may beat the restore)
            await self._become_active()

    async def _become_active(self) -> None:
        self.active = True
        _logger.info("scheduler %s is now the active scheduler", self.settings.scheduler_id)
        hello = SchedulerHello(scheduler=self.settings.scheduler_id)
        try:
            await self.broker.publish(
                topology.CONTROL_EXCHANGE, topology.KEY_SCHEDULER_HELLO, hello
            )
        except InferenceError as exc:  # agents still re-register on the next reconnect
            _logger.warning("could not say hello to the agents: %s", exc)
        self._request_consumer = await self.broker.consume(
            topology.REQUEST_QUEUE, self._on_request, prefetch=REQUEST_PREFETCH
        )
        self._status_changed.set()

    def _check_leadership(self) -> None:
        """Connection lost: the broker requeues our token (maybe to a standby): step down."""
        if self.active and not self.broker.healthy:
            self._step_down("the scheduler lost its broker connection")

    def _step_down(self, why: str) -> None:
        self.active = False
        self._token = None
        _logger.warning("%s: stepping down; failing open requests", why)
        self._emit(self.machine.shutdown(f"{why}; request outcome unknown, retry", self.clock()))
        consumer, self._request_consumer = self._request_consumer, ""
        if consumer:
            self._outbox.put_nowait(_CancelConsumer(consumer))

    async def _drain(self) -> None:
        """Stop taking requests; give open ones --drain-seconds; refuse the rest."""
        if self._request_consumer:
            try:
                await self.broker.cancel(self._request_consumer)
            except Exception as exc:  # broker gone: nothing more will be delivered anyway
                _logger.warning("could not cancel the request consumer: %s", exc)
        open_now = self.machine.open_requests
        _logger.info(
            "draining: %d request(s) open, waiting up to %g s",
            open_now,
            self.settings.drain_seconds,
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), self.settings.drain_seconds)
        self._closing = True
        self._emit(self.machine.shutdown(SHUTDOWN_MESSAGE, self.clock()))

    def _log_catalog(self) -> None:
        for servable in self.catalog.servables.values():
            for version, entry in sorted(servable.versions.items()):
                group = entry.group
                methods = ", ".join(sorted(entry.methods)) or "none"
                _logger.info(
                    "%s v%d: rank_size %d, stage_size %d, methods: %s",
                    servable.name,
                    version,
                    group.rank_size,
                    group.stage_size,
                    methods,
                )

    # ------------------------------------------------------------------ consumers

    async def _on_request(self, message: Message, incoming: AbstractIncomingMessage) -> None:
        if not isinstance(message, InferRequest) or not incoming.reply_to:
            await self._dead_letter_request(message, incoming)
            return
        token = request_id_var.set(message.id)
        try:
            correlation_id = incoming.correlation_id or message.id
            self._emit(self._admit(message, incoming.reply_to, correlation_id))
        finally:
            request_id_var.reset(token)

    def _admit(self, request: InferRequest, reply_to: str, correlation_id: str) -> list[Action]:
        if self._closing:
            return [
                error_reply(
                    request, reply_to, correlation_id, ErrorCode.UNAVAILABLE, SHUTDOWN_MESSAGE
                )
            ]
        try:
            call = resolve(self.catalog, self.registry, request, reply_to, correlation_id)
        except InferenceError as exc:
            self.refused_requests += 1
            _logger.info("request refused (%s): %s", exc.code.value, exc.message)
            return [error_reply(request, reply_to, correlation_id, exc.code, exc.message)]
        return self.machine.accept(call, self.clock())

    async def _dead_letter_request(
        self, message: Message, incoming: AbstractIncomingMessage
    ) -> None:
        self.dead_lettered_requests += 1
        why = "it has no reply_to" if isinstance(message, InferRequest) else "it is not a request"
        _logger.warning(
            "dead-lettering a %s from the request queue: %s (%d so far)",
            message.kind,
            why,
            self.dead_lettered_requests,
        )
        await incoming.reject(requeue=False)

    async def _on_result(self, message: Message, incoming: AbstractIncomingMessage) -> None:
        if not isinstance(message, StageResult):
            _logger.warning("ignoring a %s on the result queue", message.kind)
            return
        self._emit(self.machine.on_result(message, self.clock()))

    async def _on_control(self, message: Message, incoming: AbstractIncomingMessage) -> None:
        now = self.clock()
        if isinstance(message, AgentHello):
            await self._answer_hello(message, now)
        elif isinstance(message, AgentHeartbeat):
            if not self.registry.heartbeat(message, now) and not self.active:
                # A standby started after this agent registered: learn it from its beat.
                self.registry.hello(AgentHello(**message.model_dump(exclude={"kind"})), now)
        elif isinstance(message, AgentBye):
            loss = self.registry.bye(message)
            if loss is not None:
                _logger.info("%s", loss.message)
                self._emit(
                    self.machine.on_rank_lost(loss.servable, loss.version, loss.message, now)
                )
        elif isinstance(message, RepositoryCommand):
            await self._on_command(message)
        else:
            _logger.debug("ignoring a %s on the control queue", message.kind)
        self._check_readiness()

    async def _answer_hello(self, hello: AgentHello, now: float) -> None:
        verdict = self.registry.hello(hello, now)
        if not self.active:
            return  # a standby learns the agent; the active scheduler answers it
        if verdict.accepted:
            _logger.info(
                "accepted %s rank %d of %s v%d (host %s, pid %d)",
                hello.instance,
                hello.rank,
                hello.servable,
                hello.version,
                hello.host,
                hello.pid,
            )
        else:
            _logger.warning("refused %s: %s", hello.instance, verdict.reason)
        answer = RegistrationVerdict(
            instance=hello.instance,
            accepted=verdict.accepted,
            reason=verdict.reason,
            retry_after_s=verdict.retry_after_s,
        )
        key = topology.agent_control_key(hello.instance)
        try:
            await self.broker.publish(topology.CONTROL_EXCHANGE, key, answer, confirm=True)
        except InferenceError as exc:
            _logger.warning("could not deliver the verdict to %s: %s", hello.instance, exc)

    # ------------------------------------------------------------------ background loops

    async def _tick_loop(self) -> None:
        while True:
            timeout = TICK_SECONDS
            due = self.machine.next_wakeup()
            if due is not None:
                timeout = min(timeout, max(0.0, due - self.clock()))
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._tick(self.clock())

    def _tick(self, now: float) -> None:
        self._check_leadership()
        for loss in self.registry.tick(now):
            _logger.warning("%s", loss.message)
            self._emit(self.machine.on_rank_lost(loss.servable, loss.version, loss.message, now))
        for failure in self.registry.expired_waits(now):
            _logger.error("%s", failure)
            self._status_changed.set()
        self._emit(self.machine.tick(now))
        self._finish_unloads()
        self._check_readiness()

    def _check_readiness(self) -> None:
        readiness = self.registry.readiness()
        if readiness == self._readiness:
            return
        for key, ready in sorted(readiness.items()):
            if self._readiness.get(key) != ready:
                group = self.registry.groups[key]
                _logger.info("%s", f"{group.name} is ready" if ready else group.not_ready_reason())
        self._readiness = readiness
        self._status_changed.set()

    async def _status_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._status_changed.wait(), self.settings.status_interval)
            self._status_changed.clear()
            if self.active:  # a standby stays silent: gateways follow one scheduler
                await self._publish_status()

    async def _publish_status(self) -> None:
        status = mesh_status(
            self.settings.scheduler_id,
            self.catalog,
            self.registry,
            self.machine,
            self.clock(),
            dead_lettered=self.dead_lettered_requests,
        )
        try:
            await self.broker.publish(
                topology.CONTROL_EXCHANGE, topology.KEY_SCHEDULER_STATUS, status
            )
        except InferenceError as exc:
            _logger.warning("could not publish the mesh status: %s", exc)

    # ------------------------------------------------------------------ actions

    def _emit(self, actions: Iterable[Action]) -> None:
        for action in actions:
            self._outbox.put_nowait(action)
        if self.machine.next_wakeup() is not None:
            self._wake.set()
        if self.machine.open_requests:
            self._idle.clear()
        else:
            self._idle.set()

    async def _send_loop(self) -> None:
        while (action := await self._outbox.get()) is not None:
            await self._execute(action)

    async def _execute(self, action: _Outgoing) -> None:
        if isinstance(action, _SendVerdict):
            await self._send_verdict(action.verdict)
            return
        if isinstance(action, RunPython):
            self._start_python(action)
            return
        if isinstance(action, _CancelConsumer):
            try:
                await self.broker.cancel(action.consumer_tag)
            except Exception as exc:  # the consumer died with the old connection anyway
                _logger.debug("could not cancel the request consumer: %s", exc)
            return
        if isinstance(action, Log):
            token = request_id_var.set(action.request_id)
            _logger.log(action.level, "%s", action.message)
            request_id_var.reset(token)
            return
        try:
            await self._publish_action(action)
        except InferenceError as exc:
            self._publish_failed(action, exc)

    async def _publish_action(self, action: PublishStageWork | Reply | Cancel) -> None:
        if isinstance(action, PublishStageWork):
            work = action.work
            await self.broker.publish(
                topology.STAGE_EXCHANGE, action.routing_key, work, deadline=work.deadline
            )
        elif isinstance(action, Reply):
            await self.broker.publish(
                "", action.reply_to, action.reply, correlation_id=action.correlation_id
            )
        else:
            await self.broker.publish(topology.CONTROL_EXCHANGE, action.routing_key, action.cancel)

    def _publish_failed(self, action: Action, exc: InferenceError) -> None:
        if isinstance(action, PublishStageWork):
            _logger.warning("could not publish job %s: %s", action.work.job, exc)
            self._emit(self.machine.on_publish_failed(action.work.job, exc.message, self.clock()))
        elif isinstance(action, Reply):
            token = request_id_var.set(action.reply.id)
            _logger.warning("reply to %s lost (the gateway is gone?): %s", action.reply_to, exc)
            request_id_var.reset(token)
        else:
            _logger.warning("could not publish a job cancel: %s", exc)

    # ------------------------------------------------------------------ Python stages

    def _start_python(self, action: RunPython) -> None:
        if self._tasks is None or self._closing:
            return  # stopping: the machine has already answered every request
        run = self._tasks.create_task(self._run_python(action), name=f"py-{action.task.id}")
        self._python_runs.add(run)
        run.add_done_callback(self._python_runs.discard)

    async def _run_python(self, action: RunPython) -> None:
        loop = asyncio.get_running_loop()
        outcomes = await loop.run_in_executor(self._pool, run_python_task, action.task)
        self._emit(self.machine.on_python_done(action.task.id, outcomes, self.clock()))

    # ------------------------------------------------------------------ repository changes

    async def _poll_loop(self) -> None:
        interval = self.settings.repository_poll_seconds
        if interval <= 0:
            return
        while True:
            await asyncio.sleep(interval)
            try:
                await self._rescan()
            except Exception as exc:  # a scan must never take the scheduler down
                _logger.exception("repository rescan failed: %s", exc)

    async def _rescan(self) -> None:
        result = await asyncio.to_thread(
            rescan.scan,
            self.settings.repository,
            rescan.served_keys(self.catalog),
            rescan.broken_keys(self.catalog),
            set(self._held_back),
        )
        for config in rescan.apply(self.catalog, result):
            self.registry.add_group(config)
            _logger.info(
                "loaded %s v%d (rank_size %d, stage_size %d); waiting for its agents",
                config.servable,
                config.version,
                config.rank_size,
                config.stage_size,
            )
            self._status_changed.set()
        for key in result.removed:
            if key not in self.catalog.unloading:
                _logger.info("%s v%d: its folder is gone; unloading it", *key)
                self._start_unload(key)

    async def _on_command(self, command: RepositoryCommand) -> None:
        keys = self._command_keys(command)
        _logger.info("repository command %s %s v%d", command.action, *keys_label(command))
        if command.action == "load":
            self._held_back = {
                k
                for k in self._held_back
                if k[0] != command.servable or command.version not in (0, k[1])
            }
            await self._rescan()
            return
        for key in sorted(keys):
            self._held_back.add(key)
            self._start_unload(key)

    def _command_keys(self, command: RepositoryCommand) -> set[GroupKey]:
        if command.version:
            return {(command.servable, command.version)}
        servable = self.catalog.servables.get(command.servable)
        return {(command.servable, v) for v in (servable.all_versions() if servable else [])}

    def _start_unload(self, key: GroupKey) -> None:
        if self.catalog.entry(key) is None:
            self.catalog.drop(key)  # a broken or unknown version: nothing to drain
            return
        self.catalog.unloading.add(key)
        _logger.info(
            "%s v%d is unloading: %d request(s) to finish", *key, self.machine.open_for(*key)
        )
        self._status_changed.set()

    def _finish_unloads(self) -> None:
        for key in sorted(self.catalog.unloading):
            if self.machine.open_for(*key):
                continue
            instances = self.registry.remove_group(*key)
            self.catalog.drop(key)
            self.machine.forget(*key)
            self._readiness = self.registry.readiness()
            _logger.info("%s v%d unloaded; telling %d agent(s) to leave", *key, len(instances))
            for instance in instances:
                verdict = RegistrationVerdict(
                    instance=instance, accepted=False, reason=UNLOADED_REASON
                )
                self._outbox.put_nowait(_SendVerdict(verdict))
            self._status_changed.set()

    async def _send_verdict(self, verdict: RegistrationVerdict) -> None:
        if not self.active:
            return  # the active scheduler tells the agents
        key = topology.agent_control_key(verdict.instance)
        try:
            await self.broker.publish(topology.CONTROL_EXCHANGE, key, verdict, confirm=True)
        except InferenceError as exc:
            _logger.warning("could not tell %s to leave: %s", verdict.instance, exc)


def keys_label(command: RepositoryCommand) -> tuple[str, int]:
    return command.servable, command.version
