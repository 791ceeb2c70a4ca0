"""What each property of the request hop costs RabbitMQ: raw aio-pika, no shardserve code.

    python -m benchmarks.hop_properties [--url AMQP_URL] [--messages 3000] [--rounds 2]

Publishes 48 KiB bodies (the demo request) through a topic exchange into a bounded queue
(``x-max-length`` + ``reject-publish``, like the request queue) that one consumer drains
(prefetch 64, one ack per message), 32 publishes in flight, once per variant: classic vs
quorum queue, with or without publisher confirms, ``mandatory`` and a per-message TTL.
Prints the broker's CPU ms per message (from /proc, like the other scenarios). Uses the
vhost of the URL; every queue and exchange it declares is deleted when its variant ends.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aio_pika

from benchmarks.meshes import broker_pid, cpu_seconds

BODY_BYTES = 128 * 96 * 4
IN_FLIGHT = 32


@dataclass(frozen=True)
class Variant:
    name: str
    quorum: bool
    confirm: bool
    mandatory: bool
    expiration: bool


VARIANTS = (
    Variant("classic, no confirm", False, False, False, False),
    Variant("quorum, no confirm", True, False, False, False),
    Variant("quorum, no confirm, expiration", True, False, False, True),
    Variant("quorum, confirm", True, True, False, False),
    Variant("quorum, confirm+mandatory", True, True, True, False),
    Variant("quorum, confirm+expiration", True, True, False, True),
    Variant("quorum, confirm+mandatory+expiration (mesh)", True, True, True, True),
)


async def measure(connection: aio_pika.abc.AbstractConnection, v: Variant, count: int) -> float:
    """Broker CPU ms per message for one variant."""
    publisher = await connection.channel(publisher_confirms=v.confirm, on_return_raises=v.confirm)
    consumer = await connection.channel(publisher_confirms=False)
    await consumer.set_qos(prefetch_count=64)
    tag = uuid.uuid4().hex[:8]
    exchange = await publisher.declare_exchange(
        f"bench.props.{tag}", aio_pika.ExchangeType.TOPIC, auto_delete=True
    )
    arguments: dict[str, Any] = {"x-max-length": 10_000, "x-overflow": "reject-publish"}
    if v.quorum:
        arguments["x-queue-type"] = "quorum"
    queue = await consumer.declare_queue(
        f"bench.props.{tag}", durable=v.quorum, arguments=arguments
    )
    await queue.bind(exchange.name, "#")
    received = 0
    all_in = asyncio.Event()

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        nonlocal received
        await message.ack()
        received += 1
        if received >= count:
            all_in.set()

    await queue.consume(on_message)
    body = b"q" * BODY_BYTES
    slots = asyncio.Semaphore(IN_FLIGHT)

    async def publish_one() -> None:
        async with slots:
            message = aio_pika.Message(body, expiration=30.0 if v.expiration else None)
            await exchange.publish(message, "servable", mandatory=v.mandatory)

    pid = broker_pid()
    assert pid is not None, "RabbitMQ's process is not visible from here"
    before = cpu_seconds(pid)
    await asyncio.gather(*(publish_one() for _ in range(count)))
    await asyncio.wait_for(all_in.wait(), 120)
    cost = (cpu_seconds(pid) - before) * 1000.0 / count
    await queue.delete(if_unused=False, if_empty=False)
    await publisher.close()
    await consumer.close()
    return cost


async def run(url: str, count: int, rounds: int) -> None:
    connection = await aio_pika.connect(url)
    try:
        for index in range(rounds):
            for variant in VARIANTS:
                began = time.perf_counter()
                cost = await measure(connection, variant, count)
                rate = count / (time.perf_counter() - began)
                print(
                    f"round {index + 1}  {variant.name:<46} {cost:6.3f} ms/msg  {rate:6.0f} msg/s"
                )
    finally:
        await connection.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hop_properties")
    default_url = os.environ.get("SHARDSERVE_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--url", default=default_url)
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    asyncio.run(run(args.url, args.messages, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
