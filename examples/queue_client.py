"""Call a shardserve servable through the queue-level API, with nothing but aio-pika,
msgpack and numpy (no shardserve import): what any other system can do.

    python examples/queue_client.py --amqp-url amqp://guest:guest@127.0.0.1:5672/

It declares its own exclusive reply queue, publishes one InferRequest for the demo
servable "matmul" (x = ones 128x96 float32) to the topic exchange shardserve.requests with
routing key "matmul", reply_to and a unique correlation_id, waits for the InferReply with
that correlation_id and prints the output (-48.0 everywhere). See docs/queue-api.md.
Exit codes: 0 success, 1 error reply, 2 no reply in time or the mesh is not there.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import struct
import sys
import time
import uuid
from typing import Any

import aio_pika
import msgpack
import numpy as np

REQUESTS_EXCHANGE = "shardserve.requests"
CONTENT_TYPE = "application/msgpack"


def encode_tensor(array: np.ndarray) -> dict[str, Any]:
    """Tensor layout: numpy dtype string, shape, raw little-endian row-major bytes."""
    array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return {"dtype": array.dtype.str, "shape": list(array.shape), "data": array.tobytes()}


def decode_tensor(tensor: dict[str, Any]) -> np.ndarray:
    shape = tuple(tensor["shape"])
    if tensor["dtype"] == "bytes":  # BYTES: 4-byte little-endian length + bytes, per element
        items, offset, data = [], 0, tensor["data"]
        while offset < len(data):
            (length,) = struct.unpack_from("<I", data, offset)
            items.append(data[offset + 4 : offset + 4 + length])
            offset += 4 + length
        return np.array(items, dtype=object).reshape(shape)
    return np.frombuffer(tensor["data"], dtype=np.dtype(tensor["dtype"])).reshape(shape)


def infer_request(servable: str, inputs: dict[str, np.ndarray], deadline: float) -> bytes:
    message = {
        "v": 1,  # schema version
        "kind": "infer.request",
        "id": f"example-{uuid.uuid4().hex[:8]}",  # your own label, echoed in the reply
        "servable": servable,
        "version": 0,  # 0 = highest ready version
        "method": "predict",
        "instances": [{name: encode_tensor(a) for name, a in inputs.items()}],
        "outputs": None,  # all outputs
        "deadline": deadline,  # absolute unix seconds
    }
    return msgpack.packb(message, use_bin_type=True)


async def call(url: str, exchange_name: str, servable: str, timeout_s: float) -> dict[str, Any]:
    """Publish one InferRequest and return the decoded InferReply (a dict)."""
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()  # publisher confirms: a refused publish raises
        replies = await channel.declare_queue(exclusive=True, auto_delete=True)
        exchange = await channel.get_exchange(exchange_name, ensure=True)
        correlation_id = uuid.uuid4().hex  # unique per request: how the reply is matched
        deadline = time.time() + timeout_s
        body = infer_request(servable, {"x": np.ones((128, 96), np.float32)}, deadline)
        message = aio_pika.Message(
            body,
            content_type=CONTENT_TYPE,
            type="infer.request",
            reply_to=replies.name,
            correlation_id=correlation_id,
            expiration=timeout_s,  # seconds: a request nobody takes in time dies in the queue
        )
        await exchange.publish(message, routing_key=servable, mandatory=True)
        return await wait_reply(replies, correlation_id, timeout_s)


async def wait_reply(
    replies: aio_pika.abc.AbstractQueue, correlation_id: str, timeout_s: float
) -> dict[str, Any]:
    async with asyncio.timeout(timeout_s), replies.iterator() as messages:
        async for incoming in messages:
            async with incoming.process():
                if incoming.correlation_id == correlation_id:
                    return msgpack.unpackb(incoming.body, raw=False)
    raise RuntimeError("reply queue closed before the reply came")


def show(reply: dict[str, Any]) -> int:
    if reply.get("error"):
        print(f"error {reply['error']['code']}: {reply['error']['message']}", file=sys.stderr)
        return 1
    instance = reply["instances"][0]
    if instance.get("error"):
        print(f"error {instance['error']['code']}: {instance['error']['message']}", file=sys.stderr)
        return 1
    for name, tensor in instance["outputs"].items():
        array = decode_tensor(tensor)
        print(f"{name}: shape {array.shape} {array.dtype}, first values {array.reshape(-1)[:4]}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--amqp-url",
        default=os.environ.get("SHARDSERVE_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
    )
    parser.add_argument("--servable", default="matmul")
    parser.add_argument("--exchange", default=REQUESTS_EXCHANGE)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds")
    args = parser.parse_args()
    try:
        reply = asyncio.run(call(args.amqp_url, args.exchange, args.servable, args.timeout))
    except TimeoutError:
        print(f"no reply within {args.timeout:g}s", file=sys.stderr)
        return 2
    except aio_pika.exceptions.ChannelNotFoundEntity:
        print(f"exchange {args.exchange!r} does not exist: is the mesh running?", file=sys.stderr)
        return 2
    except aio_pika.exceptions.DeliveryError as exc:
        print(f"the broker refused the request (no queue, or full): {exc}", file=sys.stderr)
        return 2
    return show(reply)


if __name__ == "__main__":
    sys.exit(main())
