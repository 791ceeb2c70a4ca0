"""The scheduler's I/O shell: broker messages in, the pure core's actions out.

Tasks (one TaskGroup owns them): the *sender* executes actions in the order the core
produced them (``sender``: every StageWork leaves from one channel, in order), the
*ticker* drives heartbeat timeouts, deadlines and batch delays (it wakes early when a
batch is due), the *status* loop broadcasts MeshStatus, the *poller* rescans the
repository (``repository_changes``), the *leadership* loop decides whether this
scheduler is the active one (``leadership``). Python stages run in a thread pool
(--python-workers); each run is a task of the same TaskGroup that feeds its outcome back
to the core. Consumers (requests, control, results) only call the core and queue its
actions.

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
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from aio_pika.abc import AbstractIncomingMessage

from shardserve.amqp.broker import Broker
from shardserve.errors import CodecError, InferenceError
from shardserve.wire import topology
from shardserve.wire.protocol import (
    AgentBye,
    AgentHeartbeat,
    AgentHello,
    GenerateCancel,
    GenerateRequest,
    InferRequest,
    InferRequestBundle,
    Message,
    RegistrationVerdict,
    RepositoryCommand,
    SchedulerHello,
    StageResult,
    StepResult,
)
from shardserve_scheduler.core.actions import Action, RunPython
from shardserve_scheduler.core.catalog import Catalog, load_catalog, log_catalog
from shardserve_scheduler.core.generation.machine import GenerationMachine
from shardserve_scheduler.core.generation.sequences import Origin
from shardserve_scheduler.core.generation.state import Limits
from shardserve_scheduler.core.generation.texts import TextModels
from shardserve_scheduler.core.pystages import run_python_task
from shardserve_scheduler.core.registry import Registry
from shardserve_scheduler.core.requests import RequestMachine
from shardserve_scheduler.core.status import mesh_status
from shardserve_scheduler.inbox import unbind_other_request_queue
from shardserve_scheduler.intake import SHUTDOWN_MESSAGE, RequestIntake
from shardserve_scheduler.leadership import Leadership
from shardserve_scheduler.repository_changes import RepositoryChanges
from shardserve_scheduler.sender import ActionSender, CancelConsumer, SendVerdict
from shardserve_scheduler.settings import SchedulerSettings
from shardserve_scheduler.unreadable import answer_unreadable

_logger = logging.getLogger(__name__)

TICK_SECONDS = 0.1
REQUEST_PREFETCH = 256
CONTROL_PREFETCH = 256
RESULT_PREFETCH = 1024


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
        self.generation = GenerationMachine(
            self.registry,
            result_to=topology.scheduler_result_queue(settings.scheduler_id).name,
            id_prefix=uuid.uuid4().hex[:8],
            limits=Limits(
                max_running=settings.max_running_sequences,
                max_waiting=settings.max_waiting_sequences,
                max_prefill_tokens=settings.max_prefill_tokens,
                step_timeout=settings.step_timeout_seconds,
                max_decode_steps=settings.max_decode_steps,
                decode_run_ms=settings.decode_run_ms,
            ),
        )
        self.texts = TextModels(settings.repository)
        self._pool = ThreadPoolExecutor(settings.python_workers, thread_name_prefix="pystage")
        self._tasks: asyncio.TaskGroup | None = None
        self._python_runs: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()  # a batch became due sooner than the next tick
        self.broker = Broker(settings.broker, f"scheduler-{settings.scheduler_id}")
        self.dead_lettered_requests = 0
        self._status_changed = asyncio.Event()
        self._idle = asyncio.Event()  # set while no request is open (for the drain)
        self._idle.set()
        self._readiness = self.registry.readiness()
        self._request_consumer = ""
        self._request_queue = topology.request_queue_name(settings.request_queue)
        self.leadership = Leadership(
            self.broker,
            settings.scheduler_id,
            self._become_active,
            self._step_down,
            renew_every=settings.leader_renew_seconds,
        )
        self.sender = ActionSender(
            self.broker,
            publish_failed=self._publish_failed,
            stream_gone=self._stream_gone,
            start_python=self._start_python,
            is_active=lambda: self.active,
        )
        self.intake = RequestIntake(
            self.catalog,
            self.registry,
            self.texts,
            self.machine,
            self.generation,
            clock=clock,
            emit=self._emit,
        )
        self.changes = RepositoryChanges(
            settings.repository,
            self.catalog,
            self.registry,
            self.machine,
            changed=self._status_changed.set,
            send_verdict=lambda verdict: self.sender.put(SendVerdict(verdict)),
            generation=self.generation,
            texts=self.texts,
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
                self._tasks = tasks
                sender = tasks.create_task(self.sender.run(), name="sender")
                ticker = tasks.create_task(self._tick_loop(), name="ticker")
                status = tasks.create_task(self._status_loop(), name="status")
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
                for task in (poller, status, ticker, *self._python_runs):
                    task.cancel()
        finally:
            self._tasks = None
            self._pool.shutdown(wait=False, cancel_futures=True)
            await self.broker.close()
        _logger.info("scheduler stopped")

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
            self._on_result,
            prefetch=RESULT_PREFETCH,
            no_ack=True,
        )
        await self.broker.consume(
            topology.scheduler_control_queue(me).name, self._on_control, prefetch=CONTROL_PREFETCH
        )
        await self.leadership.start()

    # ------------------------------------------------------------------ leadership

    async def _become_active(self) -> None:
        """Called by the leadership loop once this scheduler holds the token."""
        hello = SchedulerHello(scheduler=self.settings.scheduler_id)
        try:
            await self.broker.publish(
                topology.CONTROL_EXCHANGE, topology.KEY_SCHEDULER_HELLO, hello
            )
        except InferenceError as exc:  # agents are re-learnt from their heartbeats anyway
            _logger.warning("could not say hello to the agents: %s", exc)
        await unbind_other_request_queue(self.broker, self.settings.request_queue)
        self._request_consumer = await self.broker.consume(
            self._request_queue,
            self._on_request,
            prefetch=REQUEST_PREFETCH,
            on_undecodable=self._on_unreadable_request,
        )
        self._status_changed.set()

    def _step_down(self, why: str) -> None:
        """Called by the leadership loop: this scheduler is no longer the active one."""
        _logger.warning("%s: stepping down; failing open requests", why)
        self._emit(self.machine.shutdown(f"{why}; request outcome unknown, retry", self.clock()))
        self._emit(self.generation.shutdown(f"{why}; generation stopped, retry", self.clock()))
        consumer, self._request_consumer = self._request_consumer, ""
        if consumer:
            self.sender.put(CancelConsumer(consumer))

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
        self.intake.closing = True
        self._emit(self.machine.shutdown(SHUTDOWN_MESSAGE, self.clock()))
        self._emit(self.generation.shutdown(SHUTDOWN_MESSAGE, self.clock()))

    # ------------------------------------------------------------------ consumers

    async def _on_request(self, message: Message, incoming: AbstractIncomingMessage) -> None:
        reply_to = incoming.reply_to
        actions: list[Action] = []
        if isinstance(message, InferRequestBundle) and reply_to:
            self.sender.bundles_understood_by(reply_to)
            for item in message.requests:
                actions += self.intake.admit(item.request, reply_to, item.correlation_id)
        elif isinstance(message, InferRequest) and reply_to:
            actions = self.intake.admit(message, reply_to, incoming.correlation_id or message.id)
        elif isinstance(message, GenerateRequest) and reply_to:
            origin = Origin(message, reply_to, incoming.correlation_id or message.id)
            await self.intake.generate(origin)
            return
        elif isinstance(message, GenerateCancel):
            await self.intake.cancel(message)
            return
        else:
            await self._dead_letter_request(message, incoming)
            return
        # Settled once per message, after all its requests: a bundle's requests share jobs.
        self._emit([*actions, *self.machine.settle(self.clock())])

    async def _on_unreadable_request(
        self, incoming: AbstractIncomingMessage, problem: CodecError
    ) -> None:
        """A request body the decoder refused (already dead-lettered): its sender is
        answered when its properties say how (``unreadable``)."""
        answer = answer_unreadable(
            incoming.reply_to, incoming.correlation_id, incoming.type, str(problem)
        )
        if answer is not None:
            self._emit([answer])

    async def _dead_letter_request(
        self, message: Message, incoming: AbstractIncomingMessage
    ) -> None:
        self.dead_lettered_requests += 1
        is_request = isinstance(message, InferRequest | InferRequestBundle | GenerateRequest)
        why = "it has no reply_to" if is_request else "it is not a request"
        _logger.warning(
            "dead-lettering a %s from the request queue: %s (%d so far)",
            message.kind,
            why,
            self.dead_lettered_requests,
        )
        await incoming.reject(requeue=False)

    async def _on_result(self, message: Message, incoming: AbstractIncomingMessage) -> None:
        if isinstance(message, StepResult):
            self._emit(self.generation.on_step_result(message, self.clock()))
            return
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
                self._emit(
                    self.generation.on_rank_lost(loss.servable, loss.version, loss.message, now)
                )
        elif isinstance(message, RepositoryCommand):
            await self.changes.on_command(message)
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
            due = _earliest(self.machine.next_wakeup(), self.generation.next_wakeup())
            if due is not None:
                timeout = min(timeout, max(0.0, due - self.clock()))
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):  # (no task per wait, as wait_for makes)
                    await self._wake.wait()
            self._tick(self.clock())

    def _tick(self, now: float) -> None:
        for loss in self.registry.tick(now):
            _logger.warning("%s", loss.message)
            self._emit(self.machine.on_rank_lost(loss.servable, loss.version, loss.message, now))
            self._emit(self.generation.on_rank_lost(loss.servable, loss.version, loss.message, now))
        for failure in self.registry.expired_waits(now):
            _logger.error("%s", failure)
            self._status_changed.set()
        self._emit(self.machine.tick(now))
        self._emit(self.generation.on_tick(now))
        if self.changes.finish_unloads():
            self._readiness = self.registry.readiness()
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
        dead, waiting = await self._queue_depths()
        status = mesh_status(
            self.settings.scheduler_id,
            self.catalog,
            self.registry,
            self.machine,
            self.clock(),
            generation=self.generation,
            dead_lettered=dead,
            request_queue_depth=waiting,
        )
        try:
            await self.broker.publish(
                topology.CONTROL_EXCHANGE, topology.KEY_SCHEDULER_STATUS, status
            )
        except InferenceError as exc:
            _logger.warning("could not publish the mesh status: %s", exc)

    async def _queue_depths(self) -> tuple[int, int]:
        """Dead letters of every service (they all share one dead-letter queue) and requests
        waiting; when the broker cannot say, what this scheduler counted itself."""
        try:
            dead = await self.broker.ready_count(topology.DEAD_LETTER_QUEUE)
            waiting = await self.broker.ready_count(self._request_queue)
        except InferenceError:
            return self.dead_lettered_requests + self.broker.dead_lettered, 0
        return dead, waiting

    # ------------------------------------------------------------------ actions

    def _emit(self, actions: Iterable[Action]) -> None:
        for action in actions:
            self.sender.put(action)
        if self.machine.next_wakeup() is not None:
            self._wake.set()
        if self.machine.open_requests or self.generation.open_sequences:
            self._idle.clear()
        else:
            self._idle.set()

    def _publish_failed(self, job_id: str, message: str) -> None:
        if self.generation.owns_step(job_id):
            self._emit(self.generation.on_publish_failed(job_id, message, self.clock()))
            return
        self._emit(self.machine.on_publish_failed(job_id, message, self.clock()))

    def _stream_gone(self, reply_to: str, correlation_id: str, why: str) -> None:
        """A chunk came back undeliverable (its reply queue is gone): nobody reads the
        stream any more, so its sequence ends now instead of running to max_tokens."""
        self._emit(self.generation.on_stream_gone(reply_to, correlation_id, why, self.clock()))

    def _start_python(self, action: RunPython) -> None:
        if self._tasks is None or self.intake.closing:
            return  # stopping: the machine has already answered every request
        run = self._tasks.create_task(self._run_python(action), name=f"py-{action.task.id}")
        self._python_runs.add(run)
        run.add_done_callback(self._python_runs.discard)

    async def _run_python(self, action: RunPython) -> None:
        loop = asyncio.get_running_loop()
        outcomes = await loop.run_in_executor(self._pool, run_python_task, action.task)
        self._emit(self.machine.on_python_done(action.task.id, outcomes, self.clock()))


def _earliest(*times: float | None) -> float | None:
    return min((t for t in times if t is not None), default=None)
