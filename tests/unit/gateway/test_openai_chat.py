"""POST /v1/chat/completions: messages and chat options mapped, chat shapes exact."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from generation_fakes import (
    HELLO_DELTAS,
    GenGateway,
    MakeGenGateway,
    chunks_of,
    gen_gateways,
    sse_events,
)

from shardserve.wire.protocol import ChatMessage, SamplingParams

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
    },
]


@pytest.fixture
async def make_gen_gateway() -> AsyncIterator[MakeGenGateway]:
    async with gen_gateways() as make:
        yield make


@pytest.fixture
async def gw(make_gen_gateway: MakeGenGateway) -> GenGateway:
    return await make_gen_gateway()


async def test_chat_whole_in_openai_shape(gw: GenGateway) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_completion_tokens": 9, "seed": 3}
    resp = await gw.client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    reply = await resp.json()
    assert reply["id"].startswith("chatcmpl-")
    assert reply["object"] == "chat.completion" and reply["model"] == "tiny"
    assert reply["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "".join(HELLO_DELTAS)},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert reply["usage"]["total_tokens"] == 9
    (sent,) = gw.scheduler.requests
    assert sent.messages == (
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Hi there"),
    )
    assert sent.prompt is None and sent.prompt_ids is None
    assert sent.sampling == SamplingParams(max_tokens=9, seed=3)


async def test_chat_stream_starts_with_the_role_and_ends_with_usage_and_done(
    gw: GenGateway,
) -> None:
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp = await gw.client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert [d["content"] for d in deltas[1:]] == [d for d in HELLO_DELTAS if d]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


async def test_chat_logprobs_in_the_chat_shape(make_gen_gateway: MakeGenGateway) -> None:
    gw = await make_gen_gateway(script=lambda r: chunks_of(["é"], logprobs=True))
    body = {"model": "tiny", "messages": MESSAGES, "logprobs": True, "top_logprobs": 1}
    reply = await (await gw.client.post("/v1/chat/completions", json=body)).json()
    entry = {"token": "é", "logprob": -0.5, "bytes": [195, 169]}
    assert reply["choices"][0]["logprobs"] == {"content": [{**entry, "top_logprobs": [entry]}]}
    assert gw.scheduler.requests[0].sampling.logprobs == 1


async def test_max_tokens_is_the_fallback_of_max_completion_tokens(gw: GenGateway) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
    assert (await gw.client.post("/v1/chat/completions", json=body)).status == 200
    assert gw.scheduler.requests[0].sampling.max_tokens == 4


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages.0.content"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 9}, "top_logprobs"),
        ({"n": 3}, "n"),
    ],
)
async def test_bad_chat_input_names_the_field(
    gw: GenGateway, extra: dict[str, object], param: str
) -> None:
    body = {"model": "tiny", "messages": MESSAGES, **extra}
    resp = await gw.client.post("/v1/chat/completions", json=body)
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == param
