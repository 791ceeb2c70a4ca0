"""Broker.consume(no_ack=True) against RabbitMQ: messages are handled without acks, a bad
one is counted and dropped (it cannot be rejected), and the consumer keeps going."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import pytest

from shardserve import topology
from shardserve.broker import Broker
from shardserve.protocol import InferReply, Message
from shardserve.settings import BrokerSettings

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
