"""The whole gateway app (create_app with its own AmqpDispatcher, status consumer and
reply consumer) over real RabbitMQ, with a fake scheduler in the test: the ``openai``
package streams a completion; a stream whose scheduler stops broadcasting ends with the
"scheduler was lost" error event; a client that leaves gets its generation cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import openai
import pytest
from aio_pika.abc import AbstractIncomingMessage
from aiohttp.test_utils import TestClient, TestServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "gateway"))
from generation_fakes import chunks_of, sse_events

from shardserve.amqp.broker import Broker
from shardserve.process.settings import BrokerSettings
from shardserve.wire import topology
from shardserve.wire.protocol import (
    GenerateCancel,
    GenerateRequest,
    MeshStatus,
    Message,
    ServableStatus,
)
from shardserve_gateway.app import create_app
from shardserve_gateway.settings import GatewaySettings

pytestmark = pytest.mark.integration

DELTAS = ["Hel", "lo", " wor", "ld"]


@dataclass
class Mesh:
    """A fake scheduler: broadcasts MeshStatus while ``alive`` and answers generations
    with DELTAS (only the first ``send`` chunks)."""

    broker: Broker
    servable: str
    send: int = len(DELTAS)
    alive: bool = True

    def __post_init__(self) -> None:
        self.cancels: asyncio.Queue[GenerateCancel] = asyncio.Queue()

    def status(self) -> MeshStatus:
        llm = ServableStatus(
            name=self.servable,
            version=1,
            ready=True,
            rank_size=1,
            stage_size=1,
            methods=(),
            ranks=(),
            generation=True,
        )
        return MeshStatus(scheduler="sched-1", time=time.time(), servables=(llm,))

    async def broadcast(self) -> None:
        while True:
            if self.alive:
                status = self.status()
                await self.broker.publish(
                    topology.CONTROL_EXCHANGE, topology.KEY_SCHEDULER_STATUS, status
                )
            await asyncio.sleep(0.1)

    async def on_request(self, message: Message, incoming: AbstractIncomingMessage) -> None:
        if isinstance(message, GenerateCancel):
            self.cancels.put_nowait(message)
            return
        assert isinstance(message, GenerateRequest)
        for chunk in chunks_of(DELTAS)[: self.send]:
            await self.broker.publish(
                "", incoming.reply_to or "", chunk, correlation_id=incoming.correlation_id
            )


async def wait_listed(client: TestClient[Any, Any]) -> None:
    """Until the gateway has the fake scheduler's status (the model is listed)."""
    for _ in range(200):
        if (await client.get("/v1/models")).status == 200:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the gateway never saw the fake scheduler's status")


@pytest.fixture
async def setup(isolated_amqp_url: str) -> AsyncIterator[tuple[TestClient[Any, Any], Mesh]]:
    broker_settings = BrokerSettings(urls=(isolated_amqp_url,))
    servable = f"llm-{uuid.uuid4().hex[:8]}"
    mesh_broker = Broker(broker_settings, name="fake-mesh")
    await mesh_broker.connect()
    mesh = Mesh(mesh_broker, servable)
    queue = topology.Queue(f"test.{servable}", exclusive=True)
    await mesh_broker.declare(
        queue, (topology.Binding(queue.name, topology.REQUESTS_EXCHANGE, servable),)
    )
    await mesh_broker.consume(queue.name, mesh.on_request, prefetch=16, no_ack=True)
    broadcasting = asyncio.create_task(mesh.broadcast())
    settings = replace(
        GatewaySettings(gateway_id=f"gw-{servable}"), broker=broker_settings, status_stale_s=1.0
    )
    client: TestClient[Any, Any] = TestClient(TestServer(create_app(settings)))
    await client.start_server()
    await wait_listed(client)
    yield client, mesh
    broadcasting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await broadcasting
    await client.close()
    await mesh_broker.close()


async def test_openai_stream_over_the_broker(setup: tuple[TestClient[Any, Any], Mesh]) -> None:
    client, mesh = setup
    async with openai.AsyncOpenAI(
        base_url=str(client.make_url("/v1")), api_key="x", max_retries=0
    ) as api:
        stream = await api.completions.create(model=mesh.servable, prompt="x", stream=True)
        assert "".join([c.choices[0].text async for c in stream]) == "".join(DELTAS)
        whole = await api.completions.create(model=mesh.servable, prompt="x")
        assert whole.choices[0].text == "".join(DELTAS)


async def test_scheduler_gone_silent_ends_the_stream_with_an_error(
    setup: tuple[TestClient[Any, Any], Mesh],
) -> None:
    client, mesh = setup
    mesh.send = 1
    resp = await client.post(
        "/v1/completions", json={"model": mesh.servable, "prompt": "x", "stream": True}
    )
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")
    mesh.alive = False  # no status any more: after status_stale_s the scheduler is lost
    started = time.monotonic()
    events = sse_events((await asyncio.wait_for(resp.content.read(), 10)).decode())
    assert json.loads(events[-1])["error"]["message"] == "the scheduler was lost; retry"
    assert time.monotonic() - started < 3.0
    await asyncio.wait_for(mesh.cancels.get(), 10)  # told anyway, should it come back


async def test_client_leaving_cancels_over_the_broker(
    setup: tuple[TestClient[Any, Any], Mesh],
) -> None:
    client, mesh = setup
    mesh.send = 1
    resp = await client.post(
        "/v1/completions", json={"model": mesh.servable, "prompt": "x", "stream": True}
    )
    await resp.content.readuntil(b"\n\n")
    resp.close()
    cancel = await asyncio.wait_for(mesh.cancels.get(), 10)
    assert cancel.reply_to.startswith("shardserve.reply.gw-llm-")
