"""Every generation stream ends with exactly one outcome, and the mesh is told to stop
when the gateway stops listening: client disconnect, deadline, scheduler lost, chunks
out of order."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from generation_fakes import (
    GenGateway,
    MakeGenGateway,
    chunks_of,
    gen_gateways,
    sse_events,
    tiny_llm,
    wait_for,
)

from shardserve.wire.protocol import GenerateChunk, GenerateRequest, MeshStatus

STREAM = {"model": "tiny", "prompt": "x", "stream": True}
WHOLE = {"model": "tiny", "prompt": "x"}


def hangs_after_one(request: GenerateRequest) -> list[GenerateChunk]:
    """One chunk, then nothing: a sequence still running (or a lost scheduler)."""
    return chunks_of(["Hel", "lo"])[:1]


@pytest.fixture
async def make_gen_gateway() -> AsyncIterator[MakeGenGateway]:
    async with gen_gateways() as make:
        yield make


@pytest.fixture
async def hanging(make_gen_gateway: MakeGenGateway) -> GenGateway:
    return await make_gen_gateway(script=hangs_after_one)


def assert_cancelled_once(gw: GenGateway) -> None:
    (cancel,) = gw.scheduler.cancels
    assert cancel.correlation_id == gw.scheduler.correlation_ids[0]
    assert cancel.reply_to == "shardserve.reply.gw-test"
    assert gw.dispatcher.streams.open_count == 0


async def test_client_disconnect_mid_stream_publishes_the_cancel(hanging: GenGateway) -> None:
    resp = await hanging.client.post("/v1/completions", json=STREAM)
    assert resp.status == 200
    first = await resp.content.readuntil(b"\n\n")
    assert json.loads(first.removeprefix(b"data: "))["choices"][0]["text"] == "Hel"
    resp.close()  # the client leaves
    await wait_for(hanging.scheduler.cancelled)
    assert_cancelled_once(hanging)


async def test_client_disconnect_before_any_chunk_publishes_the_cancel(
    make_gen_gateway: MakeGenGateway,
) -> None:
    gw = await make_gen_gateway(script=lambda r: [])
    timeout = aiohttp.ClientTimeout(total=0.3)
    with pytest.raises(TimeoutError):
        await gw.client.post("/v1/completions", json=WHOLE, timeout=timeout)
    await wait_for(gw.scheduler.cancelled)
    assert_cancelled_once(gw)


async def test_deadline_whole_is_504_and_cancels(hanging: GenGateway) -> None:
    headers = {"X-Request-Timeout": "0.3"}
    sent_at = time.time()
    resp = await hanging.client.post("/v1/completions", json=WHOLE, headers=headers)
    answered_at = time.time()
    assert resp.status == 504
    # The deadline is set when the gateway takes the request: between sending and the answer.
    assert sent_at + 0.3 <= hanging.scheduler.requests[0].deadline <= answered_at + 0.3
    error = (await resp.json())["error"]
    assert error["code"] == "deadline_exceeded" and error["type"] == "timeout"
    await wait_for(hanging.scheduler.cancelled)
    assert_cancelled_once(hanging)


async def test_deadline_mid_stream_is_a_last_error_event_and_cancels(hanging: GenGateway) -> None:
    headers = {"X-Request-Timeout": "0.3"}
    resp = await hanging.client.post("/v1/completions", json=STREAM, headers=headers)
    assert resp.status == 200
    events = sse_events(await resp.text())
    assert len(events) == 2 and "[DONE]" not in events
    assert json.loads(events[1])["error"]["code"] == "deadline_exceeded"
    await wait_for(hanging.scheduler.cancelled)
    assert_cancelled_once(hanging)


async def test_a_new_active_scheduler_fails_open_streams_at_once(hanging: GenGateway) -> None:
    resp = await hanging.client.post("/v1/completions", json=STREAM)
    await resp.content.readuntil(b"\n\n")
    hanging.view.update(MeshStatus(scheduler="standby", time=1.0, servables=(tiny_llm(),)))
    events = sse_events((await resp.content.read()).decode())
    error = json.loads(events[-1])["error"]
    assert error["message"] == "the scheduler was lost; retry"
    assert error["code"] == "unavailable"


async def test_no_status_for_too_long_fails_open_streams(hanging: GenGateway) -> None:
    task = asyncio.create_task(hanging.client.post("/v1/completions", json=WHOLE))
    await wait_for(hanging.scheduler.published)
    hanging.clock.advance(60)  # the status goes stale: the scheduler is gone
    resp = await asyncio.wait_for(task, 5)
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "1"
    assert (await resp.json())["error"]["message"] == "the scheduler was lost; retry"


@pytest.mark.parametrize(
    ("order", "what"),
    [((0, 2), "gap): expected chunk 1, got 2"), ((0, 0), "duplicate): expected chunk 1, got 0")],
)
async def test_chunks_out_of_order_end_the_stream_with_an_error(
    make_gen_gateway: MakeGenGateway, order: tuple[int, int], what: str
) -> None:
    chunks = chunks_of(["a", "b", "c"])
    gw = await make_gen_gateway(script=lambda r: [chunks[i] for i in order])
    resp = await gw.client.post("/v1/completions", json=WHOLE)
    assert resp.status == 500
    assert what in (await resp.json())["error"]["message"]
    await wait_for(gw.scheduler.cancelled)
    assert_cancelled_once(gw)


async def test_chunks_after_the_last_are_ignored(make_gen_gateway: MakeGenGateway) -> None:
    chunks = chunks_of(["a", "b"])
    extra = GenerateChunk(id="r", seq=2, text="zzz")
    gw = await make_gen_gateway(script=lambda r: [*chunks, extra])
    resp = await gw.client.post("/v1/completions", json=WHOLE)
    assert (await resp.json())["choices"][0]["text"] == "ab"
    assert gw.scheduler.cancels == []
