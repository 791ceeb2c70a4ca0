"""Broker.consume against RabbitMQ: handlers see deliveries in arrival order even when a big
one is decoded in a thread; no_ack consumers handle messages without acks, and a bad one
is counted and dropped (it cannot be rejected); a publish on a channel closed under it is
UnavailableError."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from shardserve.amqp.broker import Broker
from shardserve.errors import UnavailableError
from shardserve.process.settings import BrokerSettings
from shardserve.wire import topology
from shardserve.wire.protocol import InferReply, InstanceResult, Message
from shardserve.wire.tensors import Tensor

pytestmark = pytest.mark.integration


@dataclass
class Consumer:
    """A connected broker, an exclusive queue, and what its handler saw (reply ids)."""

    broker: Broker
    queue: str
    seen: asyncio.Queue[str] = field(default_factory=asyncio.Queue)

    async def handler(self, message: Message, incoming: object) -> None:
        assert isinstance(message, InferReply)
        self.seen.put_nowait(message.id)

    async def received(self, count: int) -> list[str]:
        return [await asyncio.wait_for(self.seen.get(), 20) for _ in range(count)]


@pytest.fixture
async def consumer(isolated_amqp_url: str) -> AsyncIterator[Consumer]:
    broker = Broker(BrokerSettings(urls=(isolated_amqp_url,)), name="consume-test")
    await broker.connect()
    try:
        queue = topology.Queue(f"test.consume.{uuid.uuid4().hex[:8]}", exclusive=True)
        await broker.declare(queue)
        yield Consumer(broker, queue.name)
    finally:
        await broker.close()


async def test_no_ack_consumer_handles_good_messages_and_drops_bad_ones(
    consumer: Consumer, caplog: pytest.LogCaptureFixture
) -> None:
    broker = consumer.broker
    await broker.consume(consumer.queue, consumer.handler, prefetch=10, no_ack=True)
    await broker.publish_raw("", consumer.queue, b"\xc1 not msgpack")
    for n in range(3):
        await broker.publish("", consumer.queue, InferReply(id=f"r{n}", servable="s"))
    assert await consumer.received(3) == ["r0", "r1", "r2"]
    deadline = time.monotonic() + 5
    while broker.dead_lettered < 1:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert await broker.ready_count(consumer.queue) == 0  # nothing waits for an ack
    # Rejecting a no-ack delivery would raise inside the consumer task (logged as an error).
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_a_small_message_after_a_big_one_reaches_the_handler_second(
    consumer: Consumer,
) -> None:
    """The big reply (4 MB: decoded in a thread) was published first, so it is handled first;
    every rank relies on this to take stage work in the order it was published."""
    big = Tensor.from_numpy(np.ones((1024, 1024), np.float32))
    outputs = (InstanceResult(outputs={"y": big}),)
    await consumer.broker.consume(consumer.queue, consumer.handler, prefetch=10)
    for n in range(3):
        big_reply = InferReply(id=f"big{n}", servable="s", instances=outputs)
        await consumer.broker.publish("", consumer.queue, big_reply)
        await consumer.broker.publish("", consumer.queue, InferReply(id=f"small{n}", servable="s"))
    assert await consumer.received(6) == ["big0", "small0", "big1", "small1", "big2", "small2"]


async def test_publishing_on_a_channel_closed_under_it_is_unavailable_not_a_crash(
    consumer: Consumer,
) -> None:
    """aiormq raises ChannelInvalidStateError (a RuntimeError, not an AMQPError) for a
    channel the broker closed a moment ago: during a node's shutdown that escaped the
    gateway's publisher as a bug and stopped its dispatcher for good."""
    broker = consumer.broker
    underlay = await broker._publish.get_underlay_channel()  # type: ignore[union-attr]
    await underlay.close()
    with pytest.raises(UnavailableError, match="message broker refused the publish"):
        await broker.publish_raw("", consumer.queue, b"x")
