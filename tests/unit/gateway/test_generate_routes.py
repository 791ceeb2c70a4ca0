"""Triton's generate extension: /v2/models/{m}[/versions/{v}]/generate(_stream)."""

from __future__ import annotations

import json
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
    sse_events,
    tiny_llm,
)

from shardserve.errors import ErrorCode
from shardserve.wire.protocol import GenerateChunk, GenerateRequest, SamplingParams


@pytest.fixture
async def make_gen_gateway() -> AsyncIterator[MakeGenGateway]:
    async with gen_gateways() as make:
        yield make


@pytest.fixture
async def gw(make_gen_gateway: MakeGenGateway) -> GenGateway:
    return await make_gen_gateway(tiny_llm(), servable("tiny", 2, (), generation=True))


async def test_generate_whole(gw: GenGateway) -> None:
    body = {
        "text_input": "Say",
        "parameters": {"max_tokens": 6, "temperature": 0, "stop": "!", "seed": 1, "top_k": 3},
    }
    resp = await gw.client.post("/v2/models/tiny/generate", json=body)
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "application/json"
    assert await resp.json() == {
        "model_name": "tiny",
        "model_version": "2",
        "text_output": "".join(HELLO_DELTAS),
        "finish_reason": "length",
    }
    (sent,) = gw.scheduler.requests
    assert (sent.prompt, sent.version) == ("Say", 2)
    assert sent.sampling == SamplingParams(
        max_tokens=6, temperature=0.0, stop=("!",), seed=1, top_k=3
    )


async def test_generate_stream_one_event_per_chunk_with_text(gw: GenGateway) -> None:
    resp = await gw.client.post(
        "/v2/models/tiny/versions/1/generate_stream", json={"text_input": "Say"}
    )
    assert resp.status == 200
    events = [json.loads(e) for e in sse_events(await resp.text())]
    assert "".join(e["text_output"] for e in events) == "".join(HELLO_DELTAS)
    # the end marker: the last event alone says how the answer ended (a cut one has none)
    assert [e.get("finish_reason") for e in events] == [None] * (len(events) - 1) + ["length"]
    assert {(e["model_name"], e["model_version"]) for e in events} == {("tiny", "1")}
    assert gw.scheduler.requests[0].version == 1


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({}, "text_input: Field required"),
        ({"text_input": "x", "parameters": {"max_tokens": 0}}, "parameters.max_tokens"),
        ({"text_input": "x", "parameters": {"beam_width": 2}}, "parameters.beam_width"),
        ({"text_input": "x", "bad_input": 1}, "bad_input"),
    ],
)
async def test_bad_generate_body_is_400_naming_the_field(
    gw: GenGateway, body: dict[str, object], needle: str
) -> None:
    resp = await gw.client.post("/v2/models/tiny/generate", json=body)
    assert resp.status == 400
    reply = await resp.json()
    assert needle in reply["error"] and reply["code"] == "bad_input"


async def test_bad_version_and_unknown_model(gw: GenGateway) -> None:
    bad = await gw.client.post("/v2/models/tiny/versions/x/generate", json={"text_input": "x"})
    assert bad.status == 400
    unknown = await gw.client.post("/v2/models/tiny/versions/9/generate", json={"text_input": "x"})
    assert unknown.status == 404


async def test_stream_error_after_start_is_an_error_object_in_a_chunk(
    make_gen_gateway: MakeGenGateway,
) -> None:
    def lost(request: GenerateRequest) -> list[GenerateChunk]:
        return [chunks_of(["a", "b"])[0], error_chunk(1, ErrorCode.RANK_LOST, "rank 0 lost")]

    gw = await make_gen_gateway(script=lost)
    resp = await gw.client.post("/v2/models/tiny/generate_stream", json={"text_input": "x"})
    assert resp.status == 200
    events = [json.loads(e) for e in sse_events(await resp.text())]
    assert events == [
        {"model_name": "tiny", "model_version": "1", "text_output": "a"},
        {"error": "rank 0 lost", "code": "rank_lost"},
    ]


async def test_stream_status_comes_from_the_first_chunk(make_gen_gateway: MakeGenGateway) -> None:
    gw = await make_gen_gateway(
        script=lambda r: [error_chunk(0, ErrorCode.BAD_INPUT, "prompt is longer than 128")]
    )
    resp = await gw.client.post("/v2/models/tiny/generate_stream", json={"text_input": "x"})
    assert resp.status == 400
    assert await resp.json() == {"error": "prompt is longer than 128", "code": "bad_input"}
