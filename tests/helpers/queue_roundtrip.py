"""One InferRequest through the queue-level API, published the way any other system would
(aio-pika and msgpack only), and its reply."""

from __future__ import annotations

import asyncio
import time
import uuid

import aio_pika

from shardserve.wire import codec
from shardserve.wire.protocol import InferReply, InferRequest

REPLY_WAIT_S = 60.0


async def roundtrip(
    connection: aio_pika.abc.AbstractConnection, request: InferRequest, *, expire: bool = True
) -> InferReply:
    """Publish one request (with an AMQP expiration at its deadline when ``expire``) to
    ``shardserve.requests`` from a fresh exclusive reply queue; return its reply."""
    channel = await connection.channel()
    replies = await channel.declare_queue(exclusive=True, auto_delete=True)
    exchange = await channel.get_exchange("shardserve.requests", ensure=True)
    correlation_id = uuid.uuid4().hex
    message = aio_pika.Message(
        codec.encode(request),
        content_type=codec.CONTENT_TYPE,
        reply_to=replies.name,
        correlation_id=correlation_id,
        expiration=max(0.001, request.deadline - time.time()) if expire else None,
    )
    await exchange.publish(message, routing_key=request.servable, mandatory=True)
    async with asyncio.timeout(REPLY_WAIT_S), replies.iterator() as incoming:
        async for reply in incoming:
            async with reply.process():
                assert reply.correlation_id == correlation_id
                return codec.decode_as(reply.body, InferReply)
    raise AssertionError("reply queue closed without a reply")
