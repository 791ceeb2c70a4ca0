"""The ``openai`` package, unchanged, against the gateway: sync and async clients,
streamed and not, and its errors (before the stream: status errors; after: APIError)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import openai
import pytest
from generation_fakes import (
    HELLO_DELTAS,
    GenGateway,
    MakeGenGateway,
    chunks_of,
    error_chunk,
    gen_gateways,
    tiny_llm,
)

from shardserve.errors import ErrorCode
from shardserve.wire.protocol import GenerateChunk, GenerateRequest

HELLO = "".join(HELLO_DELTAS)
MESSAGES: list[dict[str, str]] = [{"role": "user", "content": "Hi"}]


@pytest.fixture
async def make_gen_gateway() -> AsyncIterator[MakeGenGateway]:
    async with gen_gateways() as make:
        yield make


@pytest.fixture
async def gw(make_gen_gateway: MakeGenGateway) -> GenGateway:
    return await make_gen_gateway()


def sync_client(gw: GenGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url("/v1"), api_key="x", max_retries=0)


def async_client(gw: GenGateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url("/v1"), api_key="x", max_retries=0)


async def test_sync_client_completion_whole_and_streamed(gw: GenGateway) -> None:
    def run() -> tuple[str, str, int]:
        with sync_client(gw) as client:
            whole = client.completions.create(model="tiny", prompt="Say", max_tokens=6)
            stream = client.completions.create(model="tiny", prompt="Say", stream=True)
            joined = "".join(c.choices[0].text for c in stream)
            assert whole.usage is not None
            return whole.choices[0].text, joined, whole.usage.total_tokens

    whole, joined, total = await asyncio.to_thread(run)
    assert whole == joined == HELLO
    assert total == 9


async def test_sync_client_chat_streamed_with_usage(gw: GenGateway) -> None:
    def run() -> tuple[str, int | None, list[str | None]]:
        with sync_client(gw) as client:
            stream = client.chat.completions.create(
                model="tiny",
                messages=MESSAGES,  # type: ignore[arg-type]
                stream=True,
                stream_options={"include_usage": True},
            )
            parts, roles, usage = [], [], None
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    roles.append(choice.delta.role)
                    parts.append(choice.delta.content or "")
            return "".join(parts), usage, roles

    text, usage, roles = await asyncio.to_thread(run)
    assert text == HELLO and usage == 6
    assert roles[0] == "assistant"


async def test_async_client_chat_whole_and_completion_streamed(gw: GenGateway) -> None:
    async with async_client(gw) as client:
        chat = await client.chat.completions.create(model="tiny", messages=MESSAGES)  # type: ignore[arg-type]
        assert chat.choices[0].message.content == HELLO
        assert chat.choices[0].finish_reason == "length"
        stream = await client.completions.create(model="tiny", prompt="Say", stream=True)
        assert "".join([c.choices[0].text async for c in stream]) == HELLO
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]


async def test_errors_before_the_stream_are_status_errors(make_gen_gateway: MakeGenGateway) -> None:
    gw = await make_gen_gateway(
        tiny_llm(),
        script=lambda r: [error_chunk(0, ErrorCode.OVERLOADED, "waiting queue is full")],
    )
    async with async_client(gw) as client:
        with pytest.raises(openai.NotFoundError, match="unknown model 'nope'"):
            await client.completions.create(model="nope", prompt="x")
        with pytest.raises(openai.BadRequestError, match="one prompt per request"):
            await client.completions.create(model="tiny", prompt=["a", "b"])
        with pytest.raises(openai.InternalServerError, match="waiting queue is full") as caught:
            await client.completions.create(model="tiny", prompt="x", stream=True)
        assert caught.value.status_code == 503


async def test_error_after_the_stream_started_raises_api_error(
    make_gen_gateway: MakeGenGateway,
) -> None:
    def lost(request: GenerateRequest) -> list[GenerateChunk]:
        return [chunks_of(["Hel", "lo"])[0], error_chunk(1, ErrorCode.RANK_LOST, "rank 1 lost")]

    gw = await make_gen_gateway(script=lost)
    received: list[str] = []

    def run() -> None:
        with sync_client(gw) as client:
            stream = client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
            for chunk in stream:
                received.extend(c.delta.content or "" for c in chunk.choices)

    with pytest.raises(openai.APIError, match="rank 1 lost") as caught:
        await asyncio.to_thread(run)
    assert caught.value.body == {
        "message": "rank 1 lost",
        "type": "service_unavailable",
        "param": None,
        "code": "rank_lost",
    }
    assert "".join(received) == "Hel"
