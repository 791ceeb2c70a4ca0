"""Malformed AMQP messages, injected straight into the request queue and a work queue.

Each one must be dead-lettered (``shardserve.dead-letters``) while the consumers keep
running. The injected messages carry a ``message_id`` with a marker, so the suite counts
exactly its own dead letters (expired stage work lands in the same queue under load).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import aio_pika
import msgpack
import numpy as np

from shardserve.wire import codec, topology
from shardserve.wire.protocol import InferRequest
from shardserve.wire.tensors import Tensor


def request_without_reply_to() -> bytes:
    """A valid InferRequest; sent without ``reply_to`` nobody could get its answer."""
    request = InferRequest(
        id="chaos-no-reply-to",
        servable="matmul",
        instances=({"x": Tensor.from_numpy(np.zeros((1,), np.float32))},),
        deadline=time.time() + 30,
    )
    return codec.encode(request)


def malformed_bodies() -> dict[str, bytes]:
    """Name -> body of every malformed message the suite injects."""
    valid = request_without_reply_to()
    return {
        "random-bytes": uuid.uuid4().bytes * 8,
        "truncated-msgpack": valid[: len(valid) // 2],
        "wrong-schema-version": msgpack.packb({"v": 99, "kind": "infer.request", "id": "x"}),
        "unknown-kind": msgpack.packb({"v": 1, "kind": "chaos.bogus", "id": "x"}),
        "ext-type": msgpack.packb({"v": 1, "kind": msgpack.ExtType(5, b"boom")}),
        "oversized-array": msgpack.packb([None] * 1_100_000),
        "not-a-map": msgpack.packb([1, 2, 3]),
        "nested-bomb": b"\x91" * 5000 + b"\xc0",
    }


@dataclass
class Injection:
    """What was injected where, and what came back in the dead-letter queue."""

    marker: str
    sent: dict[str, str] = field(default_factory=dict)  # message_id -> "target/kind"
    dead_lettered: set[str] = field(default_factory=set)
    consumers_after: dict[str, int] = field(default_factory=dict)

    @property
    def missing(self) -> list[str]:
        return sorted(self.sent[m] for m in self.sent if m not in self.dead_lettered)


async def inject(amqp_url: str, work_queue: str) -> Injection:
    """Publish every malformed body to both targets; the request queue also gets a valid
    InferRequest without ``reply_to`` (only the scheduler can tell it is unusable)."""
    injection = Injection(marker=f"chaos-dl-{uuid.uuid4().hex[:8]}")
    bodies = malformed_bodies()
    no_reply = request_without_reply_to()
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        requests = await channel.get_exchange(topology.REQUESTS_EXCHANGE)
        targets = [
            ("requests", requests, "matmul", {**bodies, "infer-without-reply-to": no_reply}),
            ("work", channel.default_exchange, work_queue, bodies),
        ]
        for target, exchange, key, items in targets:
            for kind, body in items.items():
                message_id = f"{injection.marker}-{target}-{kind}"
                await exchange.publish(
                    aio_pika.Message(body, message_id=message_id), key, timeout=10
                )
                injection.sent[message_id] = f"{target}/{kind}"
    return injection


async def collect_dead_letters(amqp_url: str, injection: Injection, within_s: float) -> None:
    """Take messages off the dead-letter queue until all of ours are seen (or time is up)."""
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(topology.DEAD_LETTER_QUEUE, passive=True)
        end = time.monotonic() + within_s
        while time.monotonic() < end and injection.missing:
            message = await queue.get(no_ack=True, fail=False)
            if message is None:
                await asyncio.sleep(0.1)
                continue
            if (message.message_id or "").startswith(injection.marker):
                injection.dead_lettered.add(message.message_id or "")


async def consumer_counts(amqp_url: str, queues: list[str]) -> dict[str, int]:
    """Consumers on each queue (passive declare); -1 when the queue does not exist."""
    counts: dict[str, int] = {}
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        for name in queues:
            channel = await connection.channel()
            try:
                declared = await channel.declare_queue(name, passive=True)
                counts[name] = int(declared.declaration_result.consumer_count or 0)
                await channel.close()
            except aio_pika.exceptions.ChannelClosed:
                counts[name] = -1
    return counts


async def queue_depth(amqp_url: str, name: str) -> int:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(name, passive=True)
        return int(declared.declaration_result.message_count or 0)
