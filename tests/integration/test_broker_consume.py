"""Broker.consume against RabbitMQ: handlers see deliveries in arrival order even when a big
one is decoded in a thread; no_ack consumers handle messages without acks, and a bad one
is counted and dropped (it cannot be rejected)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import numpy as np
import pytest

from shardserve import topology
from shardserve.broker import Broker
from shardserve.protocol import InferReply, InstanceResult, Message
from shardserve.settings import BrokerSettings
from shardserve.tensors import Tensor

pytestmark = pytest.mark.integration


async def test_no_ack_consumer_handles_good_messages_and_drops_bad_ones(
    isolated_amqp_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    broker = Broker(BrokerSettings(urls=(isolated_amqp_url,)), name="no-ack-test")
    await broker.connect()
    try:
        queue = topology.Queue(f"test.noack.{uuid.uuid4().hex[:8]}", exclusive=True)
        await broker.declare(queue)
        seen: asyncio.Queue[Message] = asyncio.Queue()

        async def handler(message: Message, incoming: object) -> None:
            seen.put_nowait(message)

        await broker.consume(queue.name, handler, prefetch=10, no_ack=True)
        await broker.publish_raw("", queue.name, b"\xc1 not msgpack")
        for n in range(3):
            await broker.publish("", queue.name, InferReply(id=f"r{n}", servable="s"))
        got = [await asyncio.wait_for(seen.get(), 10) for _ in range(3)]
        assert [m.id for m in got if isinstance(m, InferReply)] == ["r0", "r1", "r2"]
        deadline = time.monotonic() + 5
        while broker.dead_lettered < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert await broker.ready_count(queue.name) == 0  # nothing waits for an ack
        # Rejecting a no-ack delivery would raise inside the consumer task (logged as an error).
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    finally:
        await broker.close()


async def test_a_small_message_after_a_big_one_reaches_the_handler_second(
    isolated_amqp_url: str,
) -> None:
    """The big reply (4 MB: decoded in a thread) was published first, so it is handled first;
    every rank relies on this to take stage work in the order it was published."""
    broker = Broker(BrokerSettings(urls=(isolated_amqp_url,)), name="order-test")
    await broker.connect()
    try:
        queue = topology.Queue(f"test.order.{uuid.uuid4().hex[:8]}", exclusive=True)
        await broker.declare(queue)
        seen: asyncio.Queue[str] = asyncio.Queue()

        async def handler(message: Message, incoming: object) -> None:
            assert isinstance(message, InferReply)
            seen.put_nowait(message.id)

        big = Tensor.from_numpy(np.ones((1024, 1024), np.float32))
        await broker.consume(queue.name, handler, prefetch=10)
        for round_ in range(3):
            await broker.publish(
                "",
                queue.name,
                InferReply(
                    id=f"big{round_}", servable="s", instances=(InstanceResult(outputs={"y": big}),)
                ),
            )
            await broker.publish("", queue.name, InferReply(id=f"small{round_}", servable="s"))
        got = [await asyncio.wait_for(seen.get(), 20) for _ in range(6)]
        assert got == ["big0", "small0", "big1", "small1", "big2", "small2"]
    finally:
        await broker.close()
