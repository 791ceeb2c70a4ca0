"""The public queue-level API: the aio-pika example, and direct publishes of good and bad
InferRequests, against RabbitMQ (a stand-in scheduler) and against a live mesh."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aio_pika
import numpy as np
import pytest
from queue_roundtrip import REPLY_WAIT_S, roundtrip

from shardserve.errors import ErrorCode
from shardserve.wire import codec
from shardserve.wire.protocol import (
    BundledRequest,
    InferReply,
    InferReplyBundle,
    InferRequest,
    InferRequestBundle,
    InstanceResult,
)
from shardserve.wire.tensors import Tensor

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "queue_client.py"


@pytest.fixture(scope="module")
def mesh(mesh_matmul8: Any) -> Any:
    """The live matmul mesh (8 ranks) from conftest: a mesh that does not start fails."""
    return mesh_matmul8


def run_example(amqp_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), "--amqp-url", amqp_url, *args],
        capture_output=True,
        text=True,
        timeout=REPLY_WAIT_S + 30,
    )


def assert_printed_minus_48(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, done.stderr
    assert "y: shape (128, 16) float32, first values [-48. -48. -48. -48.]" in done.stdout


# ---------------------------------------------------------------- the example, wire-checked


async def test_example_speaks_the_wire_format_the_codec_reads(isolated_amqp_url: str) -> None:
    """A stand-in scheduler decodes the example's message with shardserve's own codec."""
    seen: list[aio_pika.abc.AbstractIncomingMessage] = []
    async with StandInScheduler(isolated_amqp_url, "matmul", seen):
        done = await asyncio.to_thread(run_example, isolated_amqp_url, "--timeout", "30")
    assert_printed_minus_48(done)
    (message,) = seen
    assert message.content_type == codec.CONTENT_TYPE
    assert message.reply_to and len(message.correlation_id or "") == 32
    assert isinstance(message.expiration, float | int) and 0 < message.expiration <= 30  # s
    request = codec.decode_as(message.body, InferRequest)
    assert request.servable == "matmul" and request.version == 0
    assert 0 < request.deadline - time.time() <= 30


class StandInScheduler:
    """Answers InferRequests for one servable on the real exchange of a private vhost."""

    def __init__(self, url: str, servable: str, seen: list[Any]) -> None:
        self._url, self._servable, self._seen = url, servable, seen
        self._connection: aio_pika.abc.AbstractRobustConnection | None = None
        self._channel: aio_pika.abc.AbstractChannel | None = None

    async def __aenter__(self) -> None:
        self._connection = await aio_pika.connect_robust(self._url)
        self._channel = channel = await self._connection.channel()
        exchange = await channel.declare_exchange(
            "shardserve.requests", aio_pika.ExchangeType.TOPIC, durable=True
        )
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind(exchange, routing_key=self._servable)
        await queue.consume(self._answer)

    async def _answer(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        assert self._channel is not None
        async with message.process():
            self._seen.append(message)
            request = codec.decode_as(message.body, InferRequest)
            x = request.instances[0]["x"].to_numpy()
            y = -(x @ np.full((96, 16), 0.5, np.float32))
            reply = InferReply(
                id=request.id,
                servable=request.servable,
                instances=(InstanceResult(outputs={"y": Tensor.from_numpy(y)}),),
            )
            await self._channel.default_exchange.publish(
                aio_pika.Message(codec.encode(reply), correlation_id=message.correlation_id),
                routing_key=message.reply_to or "",
            )

    async def __aexit__(self, *exc: object) -> None:
        assert self._connection is not None
        await self._connection.close()


# ---------------------------------------------------------------- against a live mesh


def test_example_gets_minus_48_from_the_mesh(mesh: Any) -> None:
    assert_printed_minus_48(run_example(mesh.amqp_url))


@pytest.fixture
async def publisher(mesh: Any) -> AsyncIterator[Any]:
    connection = await aio_pika.connect(mesh.amqp_url)
    async with connection:
        yield connection


def matmul_request(x: np.ndarray, *, deadline_in_s: float = 30.0, **fields: Any) -> InferRequest:
    return InferRequest(
        id=f"queue-test-{uuid.uuid4().hex[:8]}",
        servable=fields.pop("servable", "matmul"),
        instances=({"x": Tensor.from_numpy(x)},),
        deadline=time.time() + deadline_in_s,
        **fields,
    )


async def test_direct_publish_of_a_good_request_gets_outputs(publisher: Any) -> None:
    reply = await roundtrip(publisher, matmul_request(np.ones((128, 96), np.float32)))
    assert reply.error is None, reply.error
    outputs = reply.instances[0].outputs
    assert outputs is not None and np.all(outputs["y"].to_numpy() == -48.0)


async def test_wrong_shape_gets_bad_input_like_http(publisher: Any) -> None:
    reply = await roundtrip(publisher, matmul_request(np.ones((2, 2), np.float32)))
    error = reply.error or (reply.instances[0].error if reply.instances else None)
    assert error is not None and error.code == ErrorCode.BAD_INPUT, reply
    assert "shape" in error.message and "[2, 2]" in error.message


async def test_unknown_servable_gets_not_found(publisher: Any) -> None:
    request = matmul_request(np.ones((128, 96), np.float32), servable=f"nope-{uuid.uuid4().hex}")
    reply = await roundtrip(publisher, request)
    assert reply.error is not None and reply.error.code == ErrorCode.NOT_FOUND, reply


async def test_past_deadline_gets_deadline_exceeded(publisher: Any) -> None:
    """Without an AMQP expiration the request reaches the scheduler, which answers
    deadline_exceeded. (With an expiration the broker drops it instead and no reply comes:
    the caller's own timeout fires; docs/queue-api.md says so.)"""
    request = matmul_request(np.ones((128, 96), np.float32), deadline_in_s=-10.0)
    reply = await roundtrip(publisher, request, expire=False)
    error = reply.error or (reply.instances[0].error if reply.instances else None)
    assert error is not None and error.code == ErrorCode.DEADLINE, reply


async def test_a_bundle_gets_every_reply_once(publisher: Any) -> None:
    """Three requests in one InferRequestBundle (one of them for an unknown servable): each
    correlation id is answered exactly once, as a plain InferReply or inside a bundle."""
    good = [matmul_request(np.full((128, 96), v, np.float32)) for v in (1.0, 2.0)]
    unknown = matmul_request(np.ones((128, 96), np.float32), servable="nope-bundle")
    items = [BundledRequest(correlation_id=f"b{i}", request=r) for i, r in enumerate(good)]
    items.append(BundledRequest(correlation_id="b-unknown", request=unknown))
    channel = await publisher.channel()
    replies = await channel.declare_queue(exclusive=True, auto_delete=True)
    exchange = await channel.get_exchange("shardserve.requests", ensure=True)
    bundle = InferRequestBundle(requests=tuple(items))
    message = aio_pika.Message(
        codec.encode(bundle), content_type=codec.CONTENT_TYPE, reply_to=replies.name
    )
    await exchange.publish(message, routing_key="matmul", mandatory=True)
    answered: dict[str, list[InferReply]] = {}
    async with asyncio.timeout(REPLY_WAIT_S), replies.iterator() as incoming:
        async for raw in incoming:
            async with raw.process():
                decoded = codec.decode(raw.body)
                if isinstance(decoded, InferReplyBundle):
                    for item in decoded.replies:
                        answered.setdefault(item.correlation_id, []).append(item.reply)
                else:
                    assert isinstance(decoded, InferReply)
                    answered.setdefault(raw.correlation_id or "", []).append(decoded)
            if len(answered) == 3:
                break
    assert sorted(answered) == ["b-unknown", "b0", "b1"]
    assert all(len(got) == 1 for got in answered.values())
    for key, value in (("b0", -48.0), ("b1", -96.0)):
        outputs = answered[key][0].instances[0].outputs
        assert outputs is not None and np.all(outputs["y"].to_numpy() == value)
    error = answered["b-unknown"][0].error
    assert error is not None and error.code == ErrorCode.NOT_FOUND


# ---------------------------------------------------------------- the HTTP client, same mesh


def test_http_client_against_the_live_gateway(mesh: Any) -> None:
    from shardserve.client import Client
    from shardserve.errors import BadInputError, NotFoundError

    x = {"x": np.ones((128, 96), np.float32)}
    with Client(mesh.http_url, "matmul", "predict", timeout=60) as client:
        assert np.all(client.infer(x)["y"] == -48.0)
        many = client.infer([x, {"x": np.zeros((128, 96), np.float32)}], request_id="pair")
        assert [float(m["y"][0, 0]) for m in many] == [-48.0, 0.0]
        assert np.all(client.infer_async(x).result(timeout=60)["y"] == -48.0)
        with pytest.raises(BadInputError, match="shape"):
            client.infer({"x": np.ones((2, 2), np.float32)})
    with Client(mesh.http_url, "matmul", "no_such_method") as client, pytest.raises(NotFoundError):
        client.infer(x)
