"""The control plane: agents register, beat and leave; repository commands arrive.

The control queue brings AgentHello (answered with a RegistrationVerdict by the active
scheduler only; a standby learns the agent silently), AgentHeartbeat (a standby that
started after an agent registered learns it from its beat), AgentBye (the rank is lost
at once: what runs on its group fails) and RepositoryCommand. After each message the
groups' readiness is checked, so a change is announced at once. ``say_hello`` tells every
agent that this scheduler became active (they register with it again).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aio_pika.abc import AbstractIncomingMessage

from shardserve.amqp.broker import Broker
from shardserve.errors import InferenceError
from shardserve.wire import topology
from shardserve.wire.protocol import (
    AgentBye,
    AgentHeartbeat,
    AgentHello,
    Message,
    RegistrationVerdict,
    RepositoryCommand,
    SchedulerHello,
)
from shardserve_scheduler.core.registry import Registry, Verdict
from shardserve_scheduler.machines import Machines
from shardserve_scheduler.readiness import ReadinessLog
from shardserve_scheduler.repository_changes import RepositoryChanges

_logger = logging.getLogger(__name__)


class ControlPlane:
    """Handles the control queue against the registry; speaks to agents when active."""

    def __init__(
        self,
        scheduler_id: str,
        broker: Broker,
        registry: Registry,
        machines: Machines,
        changes: RepositoryChanges,
        readiness: ReadinessLog,
        *,
        is_active: Callable[[], bool],
        clock: Callable[[], float],
    ) -> None:
        self._scheduler_id = scheduler_id
        self._broker = broker
        self._registry = registry
        self._machines = machines
        self._changes = changes
        self._readiness = readiness
        self._is_active = is_active
        self._clock = clock

    async def on_control(self, message: Message, incoming: AbstractIncomingMessage) -> None:
        """Broker handler of this scheduler's control queue."""
        now = self._clock()
        if isinstance(message, AgentHello):
            await self._on_hello(message, now)
        elif isinstance(message, AgentHeartbeat):
            self._on_heartbeat(message, now)
        elif isinstance(message, AgentBye):
            self._on_bye(message, now)
        elif isinstance(message, RepositoryCommand):
            await self._changes.on_command(message)
        else:
            _logger.debug("ignoring a %s on the control queue", message.kind)
        self._readiness.check()

    async def say_hello(self) -> None:
        """Tell the agents this scheduler is the active one (they register with it)."""
        hello = SchedulerHello(scheduler=self._scheduler_id)
        try:
            await self._broker.publish(
                topology.CONTROL_EXCHANGE, topology.KEY_SCHEDULER_HELLO, hello
            )
        except InferenceError as exc:  # agents are re-learnt from their heartbeats anyway
            _logger.warning("could not say hello to the agents: %s", exc)

    def _on_heartbeat(self, beat: AgentHeartbeat, now: float) -> None:
        if not self._registry.heartbeat(beat, now) and not self._is_active():
            # A standby started after this agent registered: learn it from its beat.
            self._registry.hello(AgentHello(**beat.model_dump(exclude={"kind"})), now)

    def _on_bye(self, bye: AgentBye, now: float) -> None:
        loss = self._registry.bye(bye)
        if loss is not None:
            _logger.info("%s", loss.message)
            self._machines.on_rank_lost(loss, now)

    async def _on_hello(self, hello: AgentHello, now: float) -> None:
        verdict = self._registry.hello(hello, now)
        if not self._is_active():
            return  # a standby learns the agent; the active scheduler answers it
        _log_verdict(hello, verdict)
        answer = RegistrationVerdict(
            instance=hello.instance,
            accepted=verdict.accepted,
            reason=verdict.reason,
            retry_after_s=verdict.retry_after_s,
        )
        key = topology.agent_control_key(hello.instance)
        try:
            await self._broker.publish(topology.CONTROL_EXCHANGE, key, answer, confirm=True)
        except InferenceError as exc:
            _logger.warning("could not deliver the verdict to %s: %s", hello.instance, exc)


def _log_verdict(hello: AgentHello, verdict: Verdict) -> None:
    if not verdict.accepted:
        _logger.warning("refused %s: %s", hello.instance, verdict.reason)
        return
    _logger.info(
        "accepted %s rank %d of %s v%d (host %s, pid %d)",
        hello.instance,
        hello.rank,
        hello.servable,
        hello.version,
        hello.host,
        hello.pid,
    )
