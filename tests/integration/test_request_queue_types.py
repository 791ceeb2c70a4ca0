"""The two request queue types against RabbitMQ: a scheduler that becomes active unbinds a
leftover request queue of the other type that nobody consumes (it would get a copy of
every request and, once full, make the broker refuse them all), and leaves it bound, with
an error in the log, while a scheduler consumes it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage

from shardserve.amqp.broker import Broker, QueueState
from shardserve.process.settings import BrokerSettings
from shardserve.wire import topology
from shardserve_scheduler.inbox import unbind_other_request_queue

pytestmark = pytest.mark.integration

CLASSIC, QUORUM = topology.REQUEST_QUEUE, topology.QUORUM_REQUEST_QUEUE


@pytest.fixture
async def broker(isolated_amqp_url: str) -> AsyncIterator[Broker]:
    """A connected broker with both request queues declared and bound, deleted after."""
    broker = Broker(BrokerSettings(urls=(isolated_amqp_url,)), name="request-queue-test")
    await broker.connect()
    try:
        for kind in topology.REQUEST_QUEUE_TYPES:
            bindings = topology.scheduler_bindings("t", kind)
            await broker.declare(topology.request_queue(kind), bindings)
        yield broker
    finally:
        await broker.close()
        connection = await aio_pika.connect(isolated_amqp_url)
        async with connection:
            channel = await connection.channel()
            for name in (CLASSIC, QUORUM):
                await channel.queue_delete(name)


async def _publish_one(broker: Broker) -> None:
    await broker.publish_raw(topology.REQUESTS_EXCHANGE, "matmul", b"request", confirm=True)


async def _state(broker: Broker, queue: str) -> QueueState:
    state = await broker.queue_state(queue)
    assert state is not None
    return state


async def test_queue_state_reads_messages_and_consumers_and_none_when_missing(
    broker: Broker,
) -> None:
    assert await broker.queue_state("shardserve.no-such-queue") is None
    await _publish_one(broker)
    assert await _state(broker, CLASSIC) == QueueState(ready=1, consumers=0)
    assert await broker.ready_count(CLASSIC) == 1  # the channel survived the missing queue


async def test_a_leftover_queue_of_the_other_type_is_unbound(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    await _publish_one(broker)  # both queues get it while both are bound
    with caplog.at_level(logging.WARNING):
        assert await unbind_other_request_queue(broker, "classic") is True
    assert f"unbound {QUORUM}" in caplog.text and "1 message(s) left" in caplog.text
    await _publish_one(broker)
    assert (await _state(broker, CLASSIC)).ready == 2
    assert (await _state(broker, QUORUM)).ready == 1  # nothing new since the unbind
    assert await unbind_other_request_queue(broker, "quorum") is True  # the other way round


async def test_a_consumed_queue_of_the_other_type_stays_bound_and_is_reported(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    received: asyncio.Queue[bytes] = asyncio.Queue()

    async def other_scheduler(incoming: AbstractIncomingMessage) -> None:
        received.put_nowait(incoming.body)

    await broker.consume_raw(QUORUM, other_scheduler, prefetch=10)
    with caplog.at_level(logging.ERROR):
        assert await unbind_other_request_queue(broker, "classic") is False
    assert f"1 consumer(s) on {QUORUM}" in caplog.text
    await _publish_one(broker)
    assert await asyncio.wait_for(received.get(), 10) == b"request"
    assert (await _state(broker, CLASSIC)).ready == 1


async def test_nothing_to_do_without_a_queue_of_the_other_type(isolated_amqp_url: str) -> None:
    broker = Broker(BrokerSettings(urls=(isolated_amqp_url,)), name="request-queue-alone")
    await broker.connect()
    try:
        await broker.declare(topology.request_queue(), topology.scheduler_bindings("t"))
        assert await unbind_other_request_queue(broker, "classic") is False
    finally:
        await broker.close()
