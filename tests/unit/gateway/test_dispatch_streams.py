"""AmqpDispatcher's generation streams with a stand-in broker: what is published where,
chunks routed by correlation id, and the faults that end open streams at once. (The
stream logic itself runs for real; only the broker is replaced.)"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from generation_fakes import chunks_of

from shardserve.errors import DeadlineError, InternalError, OverloadedError, UnavailableError
from shardserve.wire import topology
from shardserve.wire.protocol import GenerateCancel, GenerateChunk, GenerateRequest
from shardserve_gateway.dispatch import AmqpDispatcher
from shardserve_gateway.generation.streams import ChunkStream


@dataclass
class Incoming:
    correlation_id: str | None


@dataclass
class Broker:
    healthy: bool = True
    published: list[dict[str, Any]] = field(default_factory=list)

    async def declare(self, queue: topology.Queue, bindings: tuple[Any, ...] = ()) -> None:
        pass

    async def consume(self, queue: str, handler: Any, *, prefetch: int, no_ack: bool) -> str:
        self.handler = handler
        return "ctag"

    def add_state_listener(self, listener: Any) -> None:
        self.state_listener = listener

    async def publish(self, exchange: str, key: str, message: Any, **props: Any) -> None:
        self.published.append({"exchange": exchange, "key": key, "message": message, **props})

    async def reply(self, correlation_id: str, chunk: GenerateChunk) -> None:
        await self.handler(chunk, Incoming(correlation_id))

    def messages(self, kind: type) -> list[dict[str, Any]]:
        return [p for p in self.published if isinstance(p["message"], kind)]


def generate_request(timeout_s: float = 5.0) -> GenerateRequest:
    return GenerateRequest(id="u", servable="tiny", prompt="x", deadline=time.time() + timeout_s)


@pytest.fixture
async def broker() -> Broker:
    return Broker()


@pytest.fixture
async def dispatcher(broker: Broker) -> AmqpDispatcher:
    dispatcher = AmqpDispatcher(broker, "gw-1")  # type: ignore[arg-type]
    await dispatcher.start()
    return dispatcher


async def read_all(stream: ChunkStream) -> list[GenerateChunk]:
    return [chunk async for chunk in stream]


async def test_request_published_like_infer_and_chunks_routed_back(
    broker: Broker, dispatcher: AmqpDispatcher
) -> None:
    request = generate_request()
    async with dispatcher.generate(request) as stream:
        (sent,) = broker.published
        assert sent["exchange"] == topology.REQUESTS_EXCHANGE and sent["key"] == "tiny"
        assert sent["reply_to"] == "shardserve.reply.gw-1" and sent["confirm"] is True
        assert sent["deadline"] == request.deadline and sent["message"] == request
        for chunk in chunks_of(["a", "b", "c"]):
            await broker.reply(sent["correlation_id"], chunk)
        await broker.reply("someone-else", chunks_of(["z"])[0])
        assert [c.text for c in await read_all(stream)] == ["a", "b", "c"]
    assert broker.messages(GenerateCancel) == []
    assert dispatcher.late_replies == 1


async def test_leaving_early_publishes_a_cancel_where_the_request_went(
    broker: Broker, dispatcher: AmqpDispatcher
) -> None:
    async with dispatcher.generate(generate_request()) as stream:
        correlation_id = broker.published[0]["correlation_id"]
        await broker.reply(correlation_id, chunks_of(["a", "b"])[0])
        assert (await anext(stream)).text == "a"
    await dispatcher.streams.drain_cancels()
    (cancel,) = broker.messages(GenerateCancel)
    assert (cancel["exchange"], cancel["key"]) == (topology.REQUESTS_EXCHANGE, "tiny")
    assert cancel["message"] == GenerateCancel(
        reply_to="shardserve.reply.gw-1", correlation_id=correlation_id
    )
    assert dispatcher.streams.cancels_published == 1


async def test_deadline_ends_the_stream_and_cancels(
    broker: Broker, dispatcher: AmqpDispatcher
) -> None:
    with pytest.raises(DeadlineError):
        async with dispatcher.generate(generate_request(timeout_s=0.2)) as stream:
            await read_all(stream)
    await dispatcher.streams.drain_cancels()
    assert len(broker.messages(GenerateCancel)) == 1


@pytest.mark.parametrize("fault", ["scheduler", "broker"])
async def test_lost_scheduler_or_broker_fails_open_streams_at_once(
    broker: Broker, dispatcher: AmqpDispatcher, fault: str
) -> None:
    dispatcher.scheduler_seen("sched-a")
    async with dispatcher.generate(generate_request()) as stream:
        reading = asyncio.create_task(read_all(stream))
        await asyncio.sleep(0)  # one turn of the loop: the reader now waits on the stream
        if fault == "scheduler":
            dispatcher.scheduler_seen("sched-b")
        else:
            broker.healthy = False
            broker.state_listener(False)
        with pytest.raises(UnavailableError) as caught:
            await asyncio.wait_for(reading, 1.0)
    expected = "the scheduler was lost; retry" if fault == "scheduler" else "broker connection lost"
    assert caught.value.message.startswith(expected)


async def test_gap_is_an_internal_error(broker: Broker, dispatcher: AmqpDispatcher) -> None:
    chunks = chunks_of(["a", "b", "c"])
    async with dispatcher.generate(generate_request()) as stream:
        correlation_id = broker.published[0]["correlation_id"]
        await broker.reply(correlation_id, chunks[0])
        await broker.reply(correlation_id, chunks[2])
        assert (await anext(stream)).text == "a"
        with pytest.raises(InternalError, match="gap"):
            await anext(stream)
        with pytest.raises(StopAsyncIteration):  # exactly one outcome
            await anext(stream)


async def test_refused_while_broker_down_and_after_close(
    broker: Broker, dispatcher: AmqpDispatcher
) -> None:
    broker.healthy = False
    with pytest.raises(UnavailableError, match="unreachable"):
        dispatcher.generate(generate_request())
    broker.healthy = True
    await dispatcher.close()
    with pytest.raises(UnavailableError, match="shutting down"):
        dispatcher.generate(generate_request())


async def test_open_streams_are_bounded(broker: Broker) -> None:
    dispatcher = AmqpDispatcher(broker, "gw-1", max_inflight=1)  # type: ignore[arg-type]
    await dispatcher.start()
    async with dispatcher.generate(generate_request()):
        with pytest.raises(OverloadedError, match="limit"):
            async with dispatcher.generate(generate_request()):
                pass
