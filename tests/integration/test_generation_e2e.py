"""Generation through a real mesh at queue level: `shardserve up` on exported llama fixtures
(TP 2, and 2 stages x TP 2), GenerateRequests published with aio-pika, GenerateChunks read
from a reply queue. Greedy output equals transformers' recorded continuation; concurrent
sequences each give their alone-text; a cancel frees the KV cache; limits answer 400/503."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from shardserve.errors import ErrorCode
from shardserve.ops.child_mesh import LocalMesh, free_port
from shardserve.tools.export.hf import export_hf
from shardserve.wire import codec
from shardserve.wire.protocol import (
    GenerateCancel,
    GenerateChunk,
    GenerateRequest,
    SamplingParams,
)

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "llama"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())
SERVABLES = ("llama_tp2", "llama_pp2")
MAX_RUNNING = 16
MAX_WAITING = 2
WAIT_S = 120.0


@pytest.fixture(scope="module")
def mesh(isolated_amqp_url: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    repo = tmp_path_factory.mktemp("repo")
    export_hf(FIXTURE, repo, rank_size=2, name="llama_tp2")
    export_hf(FIXTURE, repo, rank_size=4, stage_size=2, name="llama_pp2")
    env = {
        "SHARDSERVE_SCHEDULER_MAX_RUNNING_SEQUENCES": str(MAX_RUNNING),
        "SHARDSERVE_SCHEDULER_MAX_WAITING_SEQUENCES": str(MAX_WAITING),
        # KV use shows in the status within a few tenths of a second
        "SHARDSERVE_AGENT_HEARTBEAT_INTERVAL": "0.2",
        "SHARDSERVE_SCHEDULER_STATUS_INTERVAL": "0.2",
    }
    log = tmp_path_factory.mktemp("mesh") / "mesh.log"
    mesh = LocalMesh(repo, isolated_amqp_url, free_port(), log, (), env)
    mesh.start()
    try:
        mesh.wait_ready()
        yield mesh
    finally:
        mesh.stop()


@pytest.fixture
async def connection(isolated_amqp_url: str) -> AsyncIterator[aio_pika.abc.AbstractConnection]:
    connection = await aio_pika.connect_robust(isolated_amqp_url)
    try:
        yield connection
    finally:
        await connection.close()


class Stream:
    """One generation: published on the request exchange, its chunks from a reply queue."""

    def __init__(self, channel: aio_pika.abc.AbstractChannel, queue: Any) -> None:
        self.channel, self.queue = channel, queue
        self.correlation_id = uuid.uuid4().hex
        self.chunks: list[GenerateChunk] = []

    @classmethod
    async def open(cls, connection: aio_pika.abc.AbstractConnection) -> Stream:
        channel = await connection.channel()
        queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        return cls(channel, queue)

    async def publish(self, message: GenerateRequest | GenerateCancel, servable: str) -> None:
        exchange = await self.channel.get_exchange("shardserve.requests", ensure=True)
        body = aio_pika.Message(
            codec.encode(message),
            content_type=codec.CONTENT_TYPE,
            reply_to=self.queue.name,
            correlation_id=self.correlation_id,
        )
        await exchange.publish(body, routing_key=servable, mandatory=True)

    async def start(self, servable: str, **kw: Any) -> None:
        sampling = SamplingParams(**kw.pop("sampling", {}))
        request = GenerateRequest(
            id=self.correlation_id[:8],
            servable=servable,
            sampling=sampling,
            deadline=time.time() + WAIT_S,
            **kw,
        )
        await self.publish(request, servable)

    async def cancel(self, servable: str) -> None:
        cancel = GenerateCancel(reply_to=self.queue.name, correlation_id=self.correlation_id)
        await self.publish(cancel, servable)

    async def next_chunk(self) -> GenerateChunk:
        async with asyncio.timeout(WAIT_S):
            while True:
                message = await self.queue.get(no_ack=True, fail=False)
                if message is not None:
                    assert message.correlation_id == self.correlation_id
                    chunk = codec.decode_as(message.body, GenerateChunk)
                    assert chunk.seq == len(self.chunks), "chunks out of order"
                    self.chunks.append(chunk)
                    return chunk
                await asyncio.sleep(0.005)

    async def finish(self) -> GenerateChunk:
        while not (chunk := await self.next_chunk()).last:
            pass
        return chunk

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]


async def greedy(connection: Any, servable: str, prompt: str, max_tokens: int) -> Stream:
    stream = await Stream.open(connection)
    params = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
    await stream.start(servable, prompt=prompt, sampling=params)
    last = await stream.finish()
    assert last.error is None, last.error
    return stream


@pytest.mark.parametrize("servable", SERVABLES)
async def test_greedy_equals_transformers(mesh: Any, connection: Any, servable: str) -> None:
    for prompt in REFERENCE["prompts"]:
        stream = await greedy(connection, servable, prompt["text"], len(prompt["greedy_ids"]))
        assert stream.token_ids == prompt["greedy_ids"]
        assert stream.text == prompt["greedy_text"]
        last = stream.chunks[-1]
        assert last.finish_reason == "length" and last.usage is not None
        assert last.usage.prompt_tokens == len(prompt["input_ids"])


@pytest.mark.parametrize("servable", SERVABLES)
async def test_16_concurrent_sequences_each_give_their_alone_text(
    mesh: Any, connection: Any, servable: str
) -> None:
    prompts = [p["text"] for p in REFERENCE["prompts"]]
    jobs = [(prompts[i % 3][: 10 + 3 * i], 4 + i) for i in range(16)]
    alone = [await greedy(connection, servable, p, n) for p, n in jobs[:4]]
    together = await asyncio.gather(*(greedy(connection, servable, p, n) for p, n in jobs))
    for one, many in zip(alone, together[:4], strict=False):
        assert many.token_ids == one.token_ids and many.text == one.text
    for (_, n), stream in zip(jobs, together, strict=True):
        assert len(stream.token_ids) == n


async def test_cancel_frees_the_kv_cache(mesh: Any, connection: Any) -> None:
    servable = "llama_pp2"
    stream = await Stream.open(connection)
    await stream.start(servable, prompt="Hello", sampling={"max_tokens": 120, "ignore_eos": True})
    await stream.next_chunk()
    seen_in_use = await asyncio.to_thread(wait_for, lambda: kv_used(mesh, servable) > 0, 3.0)
    await stream.cancel(servable)
    last = await stream.finish()
    assert last.error is not None and last.error.code == ErrorCode.CANCELLED
    assert seen_in_use, "the running sequence's KV cache never showed in the status"
    freed = await asyncio.to_thread(wait_for, lambda: kv_used(mesh, servable) == 0, 15.0)
    assert freed, "KV cache still in use after the cancel"


async def test_over_budget_gets_400_and_a_full_queue_503(mesh: Any, connection: Any) -> None:
    servable = "llama_tp2"
    long = await Stream.open(connection)
    await long.start(servable, prompt_ids=tuple([0] + [5] * 200))
    (refused,) = [await long.next_chunk()]
    assert refused.error is not None and refused.error.code == ErrorCode.BAD_INPUT
    assert "context is 128 tokens" in refused.error.message
    busy = [await Stream.open(connection) for _ in range(MAX_RUNNING + MAX_WAITING + 1)]
    for stream in busy:
        sampling = {"max_tokens": 120, "ignore_eos": True}
        await stream.start(servable, prompt_ids=(0, 5, 6), sampling=sampling)
    last = busy[-1]
    chunk = await last.next_chunk()
    assert chunk.error is not None and chunk.error.code == ErrorCode.OVERLOADED
    assert chunk.error.retry_after_s > 0
    for stream in busy[:-1]:
        await stream.cancel(servable)
    for stream in busy[:-1]:
        assert (await stream.finish()).last


def wait_for(condition: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def kv_used(mesh: Any, servable: str) -> int:
    return sum(int(rank.get("kv_used_bytes", 0)) for rank in mesh.ranks(servable))
