"""The AmqpDispatcher's generation streams over real RabbitMQ: a scripted scheduler on a
queue bound to the requests exchange receives the GenerateRequest (reply_to and
correlation_id set), answers GenerateChunks to the gateway's reply queue, and receives
the GenerateCancel when the gateway leaves a stream early."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aio_pika.abc import AbstractIncomingMessage

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "gateway"))
from generation_fakes import chunks_of

from shardserve.amqp.broker import Broker
from shardserve.process.settings import BrokerSettings
from shardserve.wire import topology
from shardserve.wire.protocol import GenerateCancel, GenerateRequest, Message
from shardserve_gateway.dispatch import AmqpDispatcher

pytestmark = pytest.mark.integration


@dataclass
class FakeScheduler:
    """Answers every GenerateRequest with ``deltas`` (the first ``send`` chunks of them)."""

    broker: Broker
    deltas: list[str]
    send: int
    requests: asyncio.Queue[tuple[GenerateRequest, str, str]] = field(default_factory=asyncio.Queue)
    cancels: asyncio.Queue[GenerateCancel] = field(default_factory=asyncio.Queue)

    async def on_message(self, message: Message, incoming: AbstractIncomingMessage) -> None:
        if isinstance(message, GenerateCancel):
            self.cancels.put_nowait(message)
            return
        assert isinstance(message, GenerateRequest)
        reply_to, correlation_id = incoming.reply_to or "", incoming.correlation_id or ""
        self.requests.put_nowait((message, reply_to, correlation_id))
        for chunk in chunks_of(self.deltas)[: self.send]:
            await self.broker.publish(
                "", reply_to, chunk, correlation_id=correlation_id, confirm=True
            )


@pytest.fixture
async def brokers(isolated_amqp_url: str) -> AsyncIterator[tuple[Broker, Broker]]:
    settings = BrokerSettings(urls=(isolated_amqp_url,))
    gateway, scheduler = Broker(settings, name="gen-gw"), Broker(settings, name="gen-sched")
    await gateway.connect()
    await scheduler.connect()
    yield gateway, scheduler
    await gateway.close()
    await scheduler.close()


async def start(
    brokers: tuple[Broker, Broker], deltas: list[str], send: int
) -> tuple[AmqpDispatcher, FakeScheduler, str]:
    gateway, scheduler_broker = brokers
    servable = f"gen-{uuid.uuid4().hex[:8]}"
    queue = topology.Queue(f"test.{servable}", exclusive=True)
    binding = topology.Binding(queue.name, topology.REQUESTS_EXCHANGE, servable)
    await scheduler_broker.declare(queue, (binding,))
    scheduler = FakeScheduler(scheduler_broker, deltas, send)
    await scheduler_broker.consume(queue.name, scheduler.on_message, prefetch=16, no_ack=True)
    dispatcher = AmqpDispatcher(gateway, f"gw-{servable}")
    await dispatcher.start()
    return dispatcher, scheduler, servable


def request(servable: str) -> GenerateRequest:
    return GenerateRequest(id="u", servable=servable, prompt="x", deadline=time.time() + 10)


async def test_chunks_come_back_in_order_over_the_broker(
    brokers: tuple[Broker, Broker],
) -> None:
    deltas = [f"t{i} " for i in range(50)]
    dispatcher, scheduler, servable = await start(brokers, deltas, send=50)
    async with dispatcher.generate(request(servable)) as stream:
        texts = [chunk.text async for chunk in stream]
    assert texts == deltas
    sent, reply_to, correlation_id = scheduler.requests.get_nowait()
    assert reply_to == f"shardserve.reply.gw-{servable}" and len(correlation_id) == 32
    assert sent.prompt == "x"
    # Ended by the scheduler: nothing to cancel. A second stream left early is the barrier:
    # the first cancel to come must be its own (one gateway channel, one queue: in order).
    async with dispatcher.generate(request(servable)) as stream:
        await anext(stream)
    cancel = await asyncio.wait_for(scheduler.cancels.get(), 10)
    _, _, second = scheduler.requests.get_nowait()
    assert cancel.correlation_id == second
    await dispatcher.close()


async def test_leaving_early_sends_the_cancel_to_the_scheduler(
    brokers: tuple[Broker, Broker],
) -> None:
    dispatcher, scheduler, servable = await start(brokers, ["a", "b", "c"], send=1)
    async with dispatcher.generate(request(servable)) as stream:
        assert (await anext(stream)).text == "a"
    cancel = await asyncio.wait_for(scheduler.cancels.get(), 10)
    _, reply_to, correlation_id = scheduler.requests.get_nowait()
    assert cancel == GenerateCancel(reply_to=reply_to, correlation_id=correlation_id)
    await dispatcher.close()
