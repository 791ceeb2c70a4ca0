"""The broker limit: a raw request/reply over RabbitMQ, with aio-pika as the mesh uses it.

A *hop* is one message published by one process and delivered to a consumer in another
(publish -> broker -> deliver -> ack). The requester (in the benchmark process) publishes
a request of the mesh's request payload size to a queue; the responder (its own process,
``python -m benchmarks.broker_hop``) consumes it and publishes a reply of the mesh's reply
payload size to the requester's reply queue. One round trip = 2 hops. Publishing uses no
publisher confirms, consuming uses manual acks and prefetch 256 (as the mesh's hot path).

    python -m benchmarks.broker_hop --url AMQP_URL --queue NAME --reply-bytes N
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import uuid

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection

from shardserve.process.eventloop import configured_loop_factory
from shardserve.process.heap import keep_freed_memory

PREFETCH = 256


async def serve(url: str, queue_name: str, reply_bytes: int, stop: asyncio.Event) -> None:
    """Answer every request on ``queue_name`` with ``reply_bytes`` bytes, until ``stop``."""
    connection = await aio_pika.connect_robust(url)
    try:
        consume = await connection.channel()
        await consume.set_qos(prefetch_count=PREFETCH)
        publish = await connection.channel()
        queue = await consume.declare_queue(queue_name, auto_delete=True)
        reply = b"r" * reply_bytes

        async def on_request(message: AbstractIncomingMessage) -> None:
            async with message.process():
                await publish.default_exchange.publish(
                    aio_pika.Message(reply, correlation_id=message.correlation_id),
                    routing_key=message.reply_to or "",
                )

        await queue.consume(on_request)
        print("ready", flush=True)
        await stop.wait()
    finally:
        await connection.close()


class Requester:
    """Request/reply client: one reply queue, one future per correlation id."""

    def __init__(self, url: str, queue_name: str) -> None:
        self.url = url
        self.queue_name = queue_name
        self._connection: AbstractRobustConnection | None = None
        self._publish: AbstractChannel | None = None
        self._reply_queue = f"bench.reply.{uuid.uuid4().hex[:8]}"
        self._pending: dict[str, asyncio.Future[bytes]] = {}

    async def __aenter__(self) -> Requester:
        self._connection = await aio_pika.connect_robust(self.url)
        consume = await self._connection.channel()
        await consume.set_qos(prefetch_count=PREFETCH)
        self._publish = await self._connection.channel()
        queue = await consume.declare_queue(self._reply_queue, exclusive=True, auto_delete=True)
        await queue.consume(self._on_reply)
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._connection is not None:
            await self._connection.close()

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        async with message.process():
            future = self._pending.pop(message.correlation_id or "", None)
            if future is not None and not future.done():
                future.set_result(message.body)

    async def call(self, body: bytes) -> bytes:
        assert self._publish is not None
        correlation_id = uuid.uuid4().hex
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[correlation_id] = future
        message = aio_pika.Message(body, correlation_id=correlation_id, reply_to=self._reply_queue)
        await self._publish.default_exchange.publish(message, routing_key=self.queue_name)
        async with asyncio.timeout(60):
            return await future


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.broker_hop")
    parser.add_argument("--url", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--reply-bytes", type=int, required=True)
    args = parser.parse_args(argv)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(args.url, args.queue, args.reply_bytes, stop)

    # The same event loop as the mesh's services (uvloop unless SHARDSERVE_EVENT_LOOP says)
    # and the same C heap tuning.
    keep_freed_memory()
    with asyncio.Runner(loop_factory=configured_loop_factory()) as runner:
        runner.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
