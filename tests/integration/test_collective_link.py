"""The collective link against a real RabbitMQ: two ranks' hubs exchange lean parts, a part
above the message limit goes in chunks, garbage on a collective queue comes back on the
dead-letter queue, and a connection the broker drops is made again with its queue."""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import aio_pika
import numpy as np
import pytest
import rabbitctl

from shardserve.amqp.collective import CollectiveHub
from shardserve.amqp.collective_link import CollectiveLink
from shardserve.process.settings import BrokerSettings
from shardserve.wire.topology import (
    COLLECTIVE_EXCHANGE,
    DEAD_EXCHANGE,
    Binding,
    agent_collective_queue,
    stage_key,
)

pytestmark = pytest.mark.integration


class Pair:
    """Rank 0 and rank 1 of one stage, each with its link and hub."""

    def __init__(self, url: str, **settings: object) -> None:
        self.servable = f"link-{uuid.uuid4().hex[:8]}"
        base = BrokerSettings(urls=(url,), reconnect_interval_s=0.1)
        self.settings = replace(base, **settings)  # type: ignore[arg-type]
        self.links = [self._link(rank) for rank in (0, 1)]
        self.hubs = [self._hub(rank) for rank in (0, 1)]

    def queue(self, rank: int) -> str:
        return agent_collective_queue(self.servable, 1, rank).name

    def _link(self, rank: int) -> CollectiveLink:
        key = stage_key(self.servable, 1, 0)
        queue = agent_collective_queue(self.servable, 1, rank)
        return CollectiveLink(
            self.settings,
            f"{self.servable}-r{rank}-parts",
            queue=queue,
            bindings=(Binding(queue.name, COLLECTIVE_EXCHANGE, key),),
            stage_route=(COLLECTIVE_EXCHANGE, key),
            peer_queue=self.queue,
        )

    def _hub(self, rank: int) -> CollectiveHub:
        link = self.links[rank]
        hub = CollectiveHub(
            rank=rank, stage=0, stage_ranks=(0, 1), publish=link.publish, send_to=link.send_to
        )
        link.attach(hub.accept)
        return hub

    async def allreduce(self, job: str, arrays: list[np.ndarray]) -> list[np.ndarray]:
        collectives = [hub.begin(job, time.time() + 20) for hub in self.hubs]
        sums = await asyncio.gather(
            *(c.allreduce(0, a) for c, a in zip(collectives, arrays, strict=True))
        )
        for hub in self.hubs:
            hub.finish(job)
        return list(sums)


@pytest.fixture
async def pair(isolated_amqp_url: str) -> AsyncIterator[Pair]:
    made = Pair(isolated_amqp_url)
    for link in made.links:
        await link.open()
    yield made
    for link in made.links:
        await link.close()


async def test_two_ranks_allreduce_and_send_to_the_leader(pair: Pair) -> None:
    for n in range(20):
        arrays = [np.full((1, 1024), r + n, np.float32) for r in (0, 1)]
        sums = await pair.allreduce(f"job:{n}", arrays)
        assert all(np.array_equal(s, arrays[0] + arrays[1]) for s in sums)
    at_leader = [hub.begin("final", time.time() + 20) for hub in pair.hubs]
    results = await asyncio.gather(
        *(
            c.to_leader(0, np.ones(4, np.float32) * (r + 1), sum, reduce=True)
            for r, c in enumerate(at_leader)
        )
    )
    assert results[1] is None and np.array_equal(results[0], np.full(4, 3.0, np.float32))


async def test_a_part_over_the_message_limit_travels_in_chunks(isolated_amqp_url: str) -> None:
    made = Pair(isolated_amqp_url, max_message_bytes=4096)
    for link in made.links:
        await link.open()
    try:
        arrays = [np.arange(10_000, dtype=np.float32) * (r + 1) for r in (0, 1)]
        sums = await made.allreduce("big", arrays)
        assert all(np.array_equal(s, arrays[0] + arrays[1]) for s in sums)
    finally:
        for link in made.links:
            await link.close()


async def test_garbage_on_a_collective_queue_comes_back_as_a_dead_letter(
    pair: Pair, isolated_amqp_url: str
) -> None:
    connection = await aio_pika.connect(isolated_amqp_url)
    async with connection:
        channel = await connection.channel()
        dead = await channel.declare_queue(exclusive=True)
        await dead.bind(DEAD_EXCHANGE)
        for body, message_id in ((b"\xc1garbage", "g-1"), (b"SSP1\0\0", "g-2")):
            await channel.default_exchange.publish(
                aio_pika.Message(body, message_id=message_id), routing_key=pair.queue(0)
            )
        seen: dict[str, object] = {}
        async with asyncio.timeout(10):
            while len(seen) < 2:
                message = await dead.get(no_ack=True, fail=False)
                if message is None:
                    await asyncio.sleep(0.05)
                    continue
                seen[message.message_id or ""] = message.headers["x-shardserve-dead-from"]
    assert seen == {"g-1": pair.queue(0), "g-2": pair.queue(0)}
    assert pair.links[0].dead_lettered == 2
    sums = await pair.allreduce("after", [np.ones(3, np.float32)] * 2)  # still serving
    assert np.array_equal(sums[0], np.full(3, 2.0, np.float32))


async def test_a_connection_the_broker_drops_is_made_again(pair: Pair) -> None:
    [pid] = await asyncio.to_thread(rabbitctl.connection_pids, f"{pair.servable}-r1-parts")
    await asyncio.to_thread(
        subprocess.run,
        ["rabbitmqctl", "-q", "close_connection", pid, "test: dropped"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    async with asyncio.timeout(15):
        # the link's state changes in its own task: poll it
        while pair.links[1].reconnects == 0 or not pair.links[1].connected:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    sums = await pair.allreduce("again", [np.ones(3, np.float32)] * 2)
    assert np.array_equal(sums[1], np.full(3, 2.0, np.float32))
