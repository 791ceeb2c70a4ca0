"""The scheduler's side of the control plane, played by a test that runs real agents
without a scheduler: control and result queues of its own, registration verdicts."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

from shardserve.amqp.broker import Broker
from shardserve.wire.protocol import AgentHeartbeat, AgentHello, Message, RegistrationVerdict
from shardserve.wire.topology import CONTROL_EXCHANGE, Binding, Queue, agent_control_key

WAIT = 60.0  # generous: two cores may be busy with other test processes
AGENT_CONTROL_KEYS = ("agent.hello", "agent.heartbeat", "agent.bye")


class SchedulerSide:
    """Collects the agents' control messages and results of one servable; answers hellos."""

    def __init__(self, broker: Broker, servable: str, result_type: type[Any]) -> None:
        self.broker = broker
        self.servable = servable
        self._result_type = result_type
        self.control: asyncio.Queue[Message] = asyncio.Queue()
        self.results: asyncio.Queue[Any] = asyncio.Queue()
        suffix = uuid.uuid4().hex[:8]
        self.control_queue = Queue(f"test.sched.control.{suffix}", auto_delete=True)
        self.result_queue = Queue(f"test.sched.results.{suffix}", auto_delete=True)

    async def start(self) -> None:
        name = self.control_queue.name
        bindings = tuple(Binding(name, CONTROL_EXCHANGE, key) for key in AGENT_CONTROL_KEYS)
        await self.broker.declare(self.control_queue, bindings)
        await self.broker.declare(self.result_queue)
        await self.broker.consume(name, self._on_control, prefetch=100)
        await self.broker.consume(self.result_queue.name, self._on_result, prefetch=100)

    async def _on_control(self, message: Message, _: AbstractIncomingMessage) -> None:
        if getattr(message, "servable", None) == self.servable:
            await self.control.put(message)

    async def _on_result(self, message: Message, _: AbstractIncomingMessage) -> None:
        assert isinstance(message, self._result_type), message
        await self.results.put(message)

    async def next(self, kind: type[Any], rank: int | None = None) -> Any:
        """The next control message of this kind (and rank), skipping others."""
        async with asyncio.timeout(WAIT):
            while True:
                message = await self.control.get()
                if isinstance(message, kind) and (rank is None or message.rank == rank):
                    return message

    async def verdict(self, hello: AgentHello, accepted: bool, reason: str = "") -> None:
        verdict = RegistrationVerdict(instance=hello.instance, accepted=accepted, reason=reason)
        await self.broker.publish(
            CONTROL_EXCHANGE, agent_control_key(hello.instance), verdict, confirm=True
        )

    async def register(self, rank: int) -> AgentHello:
        hello: AgentHello = await self.next(AgentHello, rank)
        await self.verdict(hello, accepted=True)
        await self.next(AgentHeartbeat, rank)  # its queues are up once it beats
        return hello
