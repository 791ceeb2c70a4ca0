"""Chunks of a bad message are dead-lettered, every one, not silently dropped, against
RabbitMQ: a lone fragment on a quiet queue once its message expires (the broker's periodic
sweep: nothing else arrives), the held chunks of a message the moment a chunk contradicts
them, and all the chunks of a message that completes but does not decode. The chunks held
were acked on arrival, so the consumer republishes them to the dead-letter exchange
itself, with their chunk headers and a reason."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage

from shardserve.amqp.broker import Broker
from shardserve.process.settings import BrokerSettings
from shardserve.wire import chunking, topology

pytestmark = pytest.mark.integration

EXPIRY_S = 1.0  # (the default is 120 s: SHARDSERVE_CHUNK_EXPIRY)


@dataclass
class Setup:
    broker: Broker
    queue: str
    publisher: aio_pika.abc.AbstractChannel
    dead: aio_pika.abc.AbstractQueue  # bound to the dead-letter exchange
    handled: list[object]

    async def publish_chunk(self, message_id: str, index: int, total: int, body: bytes) -> None:
        headers = {
            chunking.H_ID: "m-" + self.queue,
            chunking.H_INDEX: index,
            chunking.H_COUNT: 2,
            chunking.H_TOTAL: total,
        }
        message = aio_pika.Message(body, message_id=message_id, headers=headers)
        await self.publisher.default_exchange.publish(message, self.queue)

    async def dead_letters(self, count: int, within_s: float) -> list[AbstractIncomingMessage]:
        found: list[AbstractIncomingMessage] = []
        deadline = time.monotonic() + within_s
        while len(found) < count and time.monotonic() < deadline:
            got = await self.dead.get(no_ack=True, fail=False)
            if got is None:
                await asyncio.sleep(0.05)
            else:
                found.append(got)
        return found


@asynccontextmanager
async def setup(url: str, expiry_s: float, no_ack: bool) -> AsyncIterator[Setup]:
    broker = Broker(BrokerSettings(urls=(url,), chunk_expiry_s=expiry_s), name="chunk-dlx-test")
    await broker.connect()
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        dead = await channel.declare_queue(exclusive=True)
        await dead.bind(topology.DEAD_EXCHANGE)
        # Like the stage work queues (acked, with a dead-letter exchange) or the collective
        # queues (no-ack: a delivery is gone once sent).
        arguments = {} if no_ack else {"x-dead-letter-exchange": topology.DEAD_EXCHANGE}
        queue = topology.Queue(f"test.chunks.{uuid.uuid4().hex[:8]}", True, True, False, arguments)
        await broker.declare(queue)
        handled: list[object] = []

        async def handler(message: object, _: object) -> None:
            handled.append(message)

        await broker.consume(queue.name, handler, prefetch=10, no_ack=no_ack)
        yield Setup(broker, queue.name, channel, dead, handled)
    finally:
        await connection.close()
        await broker.close()


@pytest.fixture(params=[False, True], ids=["acked-queue", "no-ack-queue"])
async def expiring(isolated_amqp_url: str, request: pytest.FixtureRequest) -> AsyncIterator[Setup]:
    async with setup(isolated_amqp_url, EXPIRY_S, no_ack=request.param) as s:
        yield s


@pytest.fixture
async def patient(isolated_amqp_url: str) -> AsyncIterator[Setup]:
    async with setup(isolated_amqp_url, 60.0, no_ack=False) as s:
        yield s


async def test_a_lone_fragment_is_dead_lettered_when_its_message_expires(expiring: Setup) -> None:
    sent = time.monotonic()
    await expiring.publish_chunk("lone-1", 0, 2000, b"x" * 1000)
    [dead] = await expiring.dead_letters(1, within_s=EXPIRY_S + 5)
    waited = time.monotonic() - sent
    assert EXPIRY_S * 0.9 <= waited <= EXPIRY_S + 2  # at the expiry, by the sweep: no other chunk
    assert (dead.message_id, dead.body) == ("lone-1", b"x" * 1000)
    headers = dead.headers or {}
    assert "incomplete after 1 s (1 of 2 chunks)" in str(headers["x-shardserve-reason"])
    assert headers["x-shardserve-dead-from"] == expiring.queue
    assert (headers[chunking.H_INDEX], headers[chunking.H_COUNT]) == (0, 2)
    assert expiring.broker.dead_lettered == 1 and expiring.handled == []
    assert await expiring.broker.ready_count(expiring.queue) == 0


async def test_a_contradicting_chunk_dead_letters_itself_and_the_held_one_at_once(
    patient: Setup,
) -> None:
    sent = time.monotonic()
    await patient.publish_chunk("held", 0, 2000, b"a" * 1000)
    await patient.publish_chunk("contradicting", 1, 3000, b"b" * 1000)  # another total
    dead = {d.message_id: d for d in await patient.dead_letters(2, within_s=10)}
    assert set(dead) == {"held", "contradicting"}
    assert time.monotonic() - sent < 10  # not at the 60 s expiry
    reason = str((dead["held"].headers or {})["x-shardserve-reason"])
    assert "chunk 1 disagrees on its size" in reason
    assert patient.broker.dead_lettered == 2 and patient.handled == []


async def test_every_chunk_of_a_complete_but_undecodable_message_is_dead_lettered(
    patient: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    await patient.publish_chunk("first-half", 0, 8, b"\xc1\xc1\xc1\xc1")  # not msgpack
    await patient.publish_chunk("second-half", 1, 8, b"\xc1\xc1\xc1\xc1")
    unchunked = aio_pika.Message(b"\xc1", message_id="unchunked")
    await patient.publisher.default_exchange.publish(unchunked, patient.queue)
    dead = {d.message_id: d for d in await patient.dead_letters(3, within_s=10)}
    assert set(dead) == {"first-half", "second-half", "unchunked"}
    assert dead["first-half"].body == b"\xc1" * 4
    assert "its message:" in str((dead["first-half"].headers or {})["x-shardserve-reason"])
    assert patient.broker.dead_lettered == 3 and patient.handled == []
    chunk_lines = [r.getMessage() for r in caplog.records if "chunk(s)" in r.getMessage()]
    assert len(chunk_lines) == 1 and chunk_lines[0].startswith("dead-lettering 1 chunk(s)")
