"""``Client`` / ``AsyncClient``.generate against the real gateway app (scripted mesh):
text, streamed deltas, version, typed errors before and during the stream, and leaving a
stream early cancels the generation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from gateway_fakes import servable
from generation_fakes import (
    HELLO_DELTAS,
    GenGateway,
    MakeGenGateway,
    chunks_of,
    error_chunk,
    gen_gateways,
    tiny_llm,
    wait_for,
)

from shardserve.client import AsyncClient, Client
from shardserve.client.generation import request_body
from shardserve.errors import (
    BadInputError,
    DeadlineError,
    ErrorCode,
    NotFoundError,
    OverloadedError,
    UnavailableError,
)
from shardserve.wire.protocol import GenerateChunk, GenerateRequest, SamplingParams

HELLO = "".join(HELLO_DELTAS)


@pytest.fixture
async def make_gen_gateway() -> AsyncIterator[MakeGenGateway]:
    async with gen_gateways() as make:
        yield make


@pytest.fixture
async def gw(make_gen_gateway: MakeGenGateway) -> GenGateway:
    return await make_gen_gateway(tiny_llm(), servable("tiny", 2, (), generation=True))


async def test_async_client_text_and_stream(gw: GenGateway) -> None:
    started = time.time()
    async with AsyncClient(gw.url(""), "tiny", version_number=1, timeout=7) as client:
        text = await client.generate("Say", max_tokens=6, temperature=0, stop=["!"], seed=4)
        deltas = [d async for d in await client.generate("Say", stream=True)]
    assert text == HELLO == "".join(deltas)
    assert deltas == [d for d in HELLO_DELTAS if d]
    first, _ = gw.scheduler.requests
    assert first.version == 1 and first.prompt == "Say"
    assert first.sampling == SamplingParams(max_tokens=6, temperature=0, stop=("!",), seed=4)
    assert started + 7 <= first.deadline <= time.time() + 7  # X-Request-Timeout = timeout


async def test_sync_client_text_and_stream(gw: GenGateway) -> None:
    def run() -> tuple[str, list[str]]:
        with Client(gw.url(""), "tiny") as client:
            return client.generate("Say"), list(client.generate("Say", stream=True))

    text, deltas = await asyncio.to_thread(run)
    assert text == HELLO == "".join(deltas)
    assert gw.scheduler.requests[0].version == 2  # version 0: the gateway picks the highest


def test_an_unknown_option_is_refused_by_name_before_anything_is_sent() -> None:
    """The options are one TypedDict (shared by both clients); a misspelt one is a
    TypeError naming it, as a keyword-only parameter's would be."""
    with pytest.raises(TypeError, match=r"unknown options \['max_token'\]"):
        request_body("Say", {"max_token": 3})  # type: ignore[typeddict-unknown-key]


def test_options_left_out_are_the_servers_defaults() -> None:
    body = request_body("Say", {"stop": "!", "ignore_eos": False, "top_p": None})
    assert body == {"text_input": "Say", "parameters": {"stop": ["!"]}}  # max_tokens: the context


async def test_typed_errors_before_the_stream(make_gen_gateway: MakeGenGateway) -> None:
    gw = await make_gen_gateway(
        script=lambda r: [error_chunk(0, ErrorCode.OVERLOADED, "queue full")]
    )
    async with AsyncClient(gw.url(""), "tiny") as client:
        with pytest.raises(OverloadedError, match="queue full"):
            await client.generate("x", stream=True)
        with pytest.raises(BadInputError, match="max_tokens"):
            await client.generate("x", max_tokens=0)
    async with AsyncClient(gw.url(""), "nope") as client:
        with pytest.raises(NotFoundError):
            await client.generate("x")


async def test_typed_error_during_the_stream(make_gen_gateway: MakeGenGateway) -> None:

    def lost(request: GenerateRequest) -> list[GenerateChunk]:
        return [chunks_of(["a", "b"])[0], error_chunk(1, ErrorCode.RANK_LOST, "rank 1 lost")]

    gw = await make_gen_gateway(script=lost)

    def run() -> list[str]:
        got: list[str] = []
        with Client(gw.url(""), "tiny") as client, pytest.raises(UnavailableError) as caught:
            got.extend(client.generate("x", stream=True))
        assert caught.value.code == ErrorCode.RANK_LOST
        assert caught.value.message == "rank 1 lost"
        return got

    assert await asyncio.to_thread(run) == ["a"]


async def test_deadline_comes_from_the_client_timeout(make_gen_gateway: MakeGenGateway) -> None:
    gw = await make_gen_gateway(script=lambda r: chunks_of(["a", "b"])[:1])
    async with AsyncClient(gw.url(""), "tiny", timeout=0.4) as client:
        with pytest.raises(DeadlineError):
            await client.generate("x")


async def test_leaving_a_stream_early_cancels_the_generation(
    make_gen_gateway: MakeGenGateway,
) -> None:
    gw = await make_gen_gateway(script=lambda r: chunks_of(["a", "b"])[:1])

    def run() -> str:
        with Client(gw.url(""), "tiny") as client:
            for delta in client.generate("x", stream=True):
                return delta  # leaves the iteration: the connection closes
        return ""

    assert await asyncio.to_thread(run) == "a"
    await wait_for(gw.scheduler.cancelled)
    assert len(gw.scheduler.cancels) == 1
