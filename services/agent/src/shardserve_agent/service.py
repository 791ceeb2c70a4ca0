"""The agent service: register, serve stage work and collectives, heartbeat, drain.

Order of life: connect -> control queue -> hello until a verdict -> (refused: exit 3) ->
collective link (a connection of its own) + work consumer -> heartbeats -> ... SIGTERM ->
cancel the work consumer -> finish the job in flight (bounded) -> bye -> close.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid

from aio_pika.abc import AbstractIncomingMessage

from shardserve.amqp.broker import Broker
from shardserve.amqp.collective import CollectiveHub
from shardserve.amqp.collective_link import CollectiveLink
from shardserve.process.waits import set_within
from shardserve.runtime.kv_cache import KVCache
from shardserve.wire.protocol import (
    JobCancel,
    Message,
    RegistrationVerdict,
    SchedulerHello,
    StageResult,
    StepResult,
)
from shardserve.wire.topology import (
    COLLECTIVE_EXCHANGE,
    Binding,
    agent_bindings,
    agent_collective_queue,
    agent_control_queue,
    agent_work_queue,
    stage_key,
)
from shardserve_agent.registration import Registration
from shardserve_agent.settings import AgentSettings
from shardserve_agent.slice_loader import LoadedSlice
from shardserve_agent.worker import StageWorker

_logger = logging.getLogger(__name__)

EXIT_REFUSED = 3
# How long a restarted agent keeps asking for a rank still held by its (dead) predecessor.
RETAKE_RANK_SECONDS = 15.0
WORK_PREFETCH = 4  # small: a prefetched job is invisible to everyone else
CONTROL_PREFETCH = 100


def make_instance_id(servable: str, version: int, rank: int) -> str:
    """A unique, routing-key-safe name for this process (no dots: keys are dot-separated)."""
    base = re.sub(r"[^A-Za-z0-9_-]", "_", servable)[:64]
    return f"{base}-v{version}-r{rank}-{uuid.uuid4().hex[:12]}"


class AgentService:
    """One rank's agent, from registration to bye."""

    def __init__(
        self, settings: AgentSettings, loaded: LoadedSlice, kv_cache: KVCache | None = None
    ) -> None:
        self.settings = settings
        self.loaded = loaded
        group = loaded.group
        self.instance = make_instance_id(group.servable, group.version, loaded.rank)
        self.exit_code = 0
        self._key = stage_key(group.servable, group.version, loaded.stage.index)
        self._bindings = agent_bindings(
            group.servable, group.version, loaded.rank, loaded.stage.index, self.instance
        )
        self._broker = Broker(settings.broker, f"agent-{self.instance}")
        self._link = self._collective_link()
        self._hub = CollectiveHub(
            rank=loaded.rank,
            stage=loaded.stage.index,
            stage_ranks=loaded.stage.ranks,
            publish=self._link.publish,
            send_to=self._link.send_to,
        )
        self._link.attach(self._hub.accept)
        self._worker = StageWorker(loaded, self._hub, self._publish_result, kv_cache=kv_cache)
        self._registration = Registration(self._broker, loaded, self.instance, self._worker.stats)
        self._accepted = False

    def _collective_link(self) -> CollectiveLink:
        """This rank's collective queue and parts, on a connection of their own
        (``shardserve.amqp.collective_link``): to the stage by its key, to one peer (the
        stage leader) straight to that peer's queue."""
        group = self.loaded.group

        def peer_queue(rank: int) -> str:
            return agent_collective_queue(group.servable, group.version, rank).name

        queue = agent_collective_queue(group.servable, group.version, self.loaded.rank)
        return CollectiveLink(
            self.settings.broker,
            f"agent-{self.instance}-parts",
            queue=queue,
            bindings=(Binding(queue.name, COLLECTIVE_EXCHANGE, self._key),),
            stage_route=(COLLECTIVE_EXCHANGE, self._key),
            peer_queue=peer_queue,
        )

    async def _publish_result(self, result_to: str, result: StageResult | StepResult) -> None:
        await self._broker.publish("", result_to, result)

    async def run(self, stop: asyncio.Event) -> None:
        """The service's life; ``stop`` is set by SIGTERM/SIGINT (or a refusal)."""
        # Waits for the broker (an agent may start first); a SIGTERM meanwhile stops.
        if not await self._broker.connect_unless_stopped(stop):
            return
        try:
            await self._serve(stop)
        finally:
            await self._link.close()
            await self._broker.close()

    async def _serve(self, stop: asyncio.Event) -> None:
        control = agent_control_queue(self.instance)
        await self._broker.declare(control, self._bindings)
        await self._broker.consume(control.name, self._on_control, prefetch=CONTROL_PREFETCH)
        _logger.info(
            "agent %s ready; asking the scheduler to register rank %d",
            self.instance,
            self.loaded.rank,
        )
        verdict = await self._register(stop)
        if verdict is None:
            return
        if not verdict.accepted:
            self._refused(verdict, stop)
            return
        self._accepted = True
        _logger.info(
            "registration accepted; serving rank %d of %s v%d",
            self.loaded.rank,
            self.loaded.group.servable,
            self.loaded.group.version,
        )
        work_tag = await self._start_consumers()
        await self._serve_until_stopped(stop, work_tag)

    async def _register(self, stop: asyncio.Event) -> RegistrationVerdict | None:
        """Hello until a verdict; while our rank's previous holder (e.g. the process we
        replace after a crash) has not timed out yet, ask again instead of giving up."""
        give_up_at = time.monotonic() + RETAKE_RANK_SECONDS
        while True:
            verdict = await self._registration.next_verdict(stop)
            if verdict is None or verdict.accepted or verdict.retry_after_s <= 0:
                return verdict
            if time.monotonic() + verdict.retry_after_s > give_up_at:
                return verdict
            _logger.warning("%s; asking again in %.1f s", verdict.reason, verdict.retry_after_s)
            if await set_within(stop, verdict.retry_after_s):
                return None

    def _refused(self, verdict: RegistrationVerdict, stop: asyncio.Event) -> None:
        _logger.error(
            "the scheduler refused rank %d of %s v%d: %s",
            self.loaded.rank,
            self.loaded.group.servable,
            self.loaded.group.version,
            verdict.reason or "(no reason given)",
        )
        self.exit_code = EXIT_REFUSED
        stop.set()

    async def _start_consumers(self) -> str:
        """The collective link first: work may need a collective as soon as it comes."""
        group, rank = self.loaded.group, self.loaded.rank
        await self._link.open()
        work = agent_work_queue(group.servable, group.version, rank)
        await self._broker.declare(work, self._bindings)
        return await self._broker.consume(work.name, self._worker.handle, prefetch=WORK_PREFETCH)

    async def _serve_until_stopped(self, stop: asyncio.Event, work_tag: str) -> None:
        async with asyncio.TaskGroup() as tasks:
            beats = tasks.create_task(self._heartbeats())
            watch = tasks.create_task(self._watch_verdicts(stop))
            await stop.wait()
            await self._drain(work_tag)
            beats.cancel()
            watch.cancel()
        await self._registration.send_bye()
        _logger.info("agent %s stopped after %d job(s)", self.instance, self._worker.completed)

    async def _heartbeats(self) -> None:
        """Beat at once (our queues are up now), then every interval."""
        while True:
            await self._registration.send_heartbeat(
                "draining" if self._worker.draining else "ready"
            )
            await asyncio.sleep(self.settings.heartbeat_interval)

    async def _watch_verdicts(self, stop: asyncio.Event) -> None:
        """Verdicts after a re-hello: a new scheduler may refuse us (then exit 3)."""
        while True:
            verdict = await self._registration.verdicts()
            if not verdict.accepted:
                self._refused(verdict, stop)
                return

    async def _drain(self, work_tag: str) -> None:
        _logger.info("stopping: no new work; draining (up to %.1f s)", self.settings.drain_seconds)
        self._worker.draining = True
        try:
            await self._broker.cancel(work_tag)
        except Exception as exc:  # broker gone: nothing more will be delivered anyway
            _logger.warning("could not cancel the work consumer: %s", exc)
        if not await self._worker.wait_idle(self.settings.drain_seconds):
            _logger.warning(
                "the job in flight did not finish within %.1f s; abandoning it",
                self.settings.drain_seconds,
            )
            self._hub.abort_active("agent stopping")

    async def _on_control(self, message: Message, incoming: AbstractIncomingMessage) -> None:
        if isinstance(message, RegistrationVerdict):
            self._registration.on_verdict(message)
        elif isinstance(message, SchedulerHello):
            _logger.info("scheduler %s said hello; registering again", message.scheduler)
            self._forget_sequences(message.scheduler)
            await self._registration.send_hello()
        elif isinstance(message, JobCancel):
            self._on_cancel(message)
        else:
            _logger.warning("dropping a %s message on the control queue", message.kind)

    def _forget_sequences(self, scheduler: str) -> None:
        # A scheduler says hello when it becomes active: the sequences held here belong to
        # the one before it, which is gone, and nobody would ever free them. Its step in
        # flight goes too: a peer that freed first fails it at once ("no reservation"),
        # and this rank would otherwise wait for that peer's parts until the deadline.
        freed = self._worker.stepper.free_all()
        if freed:
            self._hub.abort_active(f"scheduler {scheduler} took over")
            _logger.warning(
                "freed the KV cache of %d sequence(s) of the previous scheduler (now %s)",
                freed,
                scheduler,
            )

    def _on_cancel(self, cancel: JobCancel) -> None:
        group = self.loaded.group
        if (cancel.servable, cancel.version) != (group.servable, group.version):
            return
        if self._hub.cancel(cancel.job, cancel.reason):
            _logger.info("job %s cancelled while running: %s", cancel.job, cancel.reason)
