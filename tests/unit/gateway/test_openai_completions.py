"""POST /v1/completions and GET /v1/models over the real app: request mapping, exact
response and SSE shapes, errors before and after the stream starts."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from gateway_fakes import MATMUL_METHODS, servable
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
from shardserve.wire.protocol import GenerateRequest, SamplingParams

HELLO = "".join(HELLO_DELTAS)


@pytest.fixture
async def make_gen_gateway() -> AsyncIterator[MakeGenGateway]:
    async with gen_gateways() as make:
        yield make


@pytest.fixture
async def gw(make_gen_gateway: MakeGenGateway) -> GenGateway:
    return await make_gen_gateway()


async def test_completion_whole_in_openai_shape(gw: GenGateway) -> None:
    resp = await gw.client.post("/v1/completions", json={"model": "tiny", "prompt": "Say"})
    assert resp.status == 200
    body = await resp.json()
    assert body["id"].startswith("cmpl-") and isinstance(body["created"], int)
    del body["id"], body["created"]
    assert body == {
        "object": "text_completion",
        "model": "tiny",
        "choices": [{"index": 0, "text": HELLO, "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9},
    }
    (sent,) = gw.scheduler.requests
    assert (sent.servable, sent.version, sent.prompt) == ("tiny", 1, "Say")
    assert sent.sampling == SamplingParams(max_tokens=16)
    assert gw.scheduler.cancels == []  # the scheduler ended the stream itself


async def test_request_fields_map_to_sampling_params(gw: GenGateway) -> None:
    body = {
        "model": "tiny",
        "prompt": [[1, 2, 3]],
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 11,
        "stop": "\n",
        "logprobs": 2,
        "stop_token_ids": [5],
        "ignore_eos": True,
        "n": 1,
        "user": "ignored like OpenAI does",
        "frequency_penalty": 0,
    }
    assert (await gw.client.post("/v1/completions", json=body)).status == 200
    (sent,) = gw.scheduler.requests
    assert sent.prompt_ids == (1, 2, 3) and sent.prompt is None
    assert sent.sampling == SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        seed=11,
        stop=("\n",),
        logprobs=2,
        stop_token_ids=(5,),
        ignore_eos=True,
    )


async def test_top_k_minus_one_means_no_cut(gw: GenGateway) -> None:
    body = {"model": "tiny", "prompt": "x", "top_k": -1}
    assert (await gw.client.post("/v1/completions", json=body)).status == 200
    assert gw.scheduler.requests[0].sampling.top_k == 0


async def test_stream_is_exact_sse_ending_with_done(gw: GenGateway) -> None:
    resp = await gw.client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "Say", "stream": True}
    )
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/event-stream"
    assert resp.headers["X-Request-Id"]
    events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    # The held-back "" delta is not sent; every other delta is, in order.
    assert [c["choices"][0]["text"] for c in chunks] == [d for d in HELLO_DELTAS if d]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)


async def test_stream_with_include_usage_ends_with_a_usage_chunk(gw: GenGateway) -> None:
    body = {
        "model": "tiny",
        "prompt": "Say",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = sse_events(await (await gw.client.post("/v1/completions", json=body)).text())
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert all(json.loads(e)["usage"] is None for e in events[:-2])


async def test_logprobs_in_the_completion_shape(make_gen_gateway: MakeGenGateway) -> None:
    gw = await make_gen_gateway(script=lambda r: chunks_of(["a", "bc"], logprobs=True))
    body = {"model": "tiny", "prompt": "x", "logprobs": 1}
    choice = (await (await gw.client.post("/v1/completions", json=body)).json())["choices"][0]
    assert choice["logprobs"] == {
        "tokens": ["a", "bc"],
        "token_logprobs": [-0.5, -0.5],
        "top_logprobs": [{"a": -0.5}, {"bc": -0.5}],
        "text_offset": [0, 1],
    }
    stream = await gw.client.post("/v1/completions", json={**body, "stream": True})
    chunks = [json.loads(e) for e in sse_events(await stream.text())[:-1]]
    offsets = [c["choices"][0]["logprobs"]["text_offset"] for c in chunks]
    assert offsets == [[0], [1]]


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"prompt": "x"}, "model", "model"),
        ({"model": "tiny", "prompt": ["a", "b"]}, "prompt", "one prompt per request"),
        ({"model": "tiny", "prompt": [[1], [2]]}, "prompt", "one prompt per request"),
        ({"model": "tiny", "prompt": []}, "prompt", "must not be empty"),
        ({"model": "tiny", "prompt": [1, -2]}, "prompt", "token ids must be >= 0"),
        ({"model": "tiny", "prompt": 5}, "prompt", "a string or a list of token ids"),
        ({"model": "tiny", "prompt": [[1, "a"]]}, "prompt", "a string or a list of token ids"),
        ({"model": "tiny"}, "prompt", "Field required"),
        ({"model": "tiny", "prompt": [[]]}, "prompt", "must not be empty"),
        ({"model": "tiny", "prompt": "x", "n": 2}, "n", "only n=1"),
        ({"model": "tiny", "prompt": "x", "echo": True}, "echo", "echo is not supported"),
        ({"model": "tiny", "prompt": "x", "logprobs": 6}, "logprobs", "less than or equal to 5"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens", "greater than"),
        ({"model": "tiny", "prompt": "x", "temperature": -1}, "temperature", "temperature"),
    ],
)
async def test_bad_input_is_a_400_in_openai_shape(
    gw: GenGateway, body: dict[str, object], param: str, needle: str
) -> None:
    resp = await gw.client.post("/v1/completions", json=body)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["code"] == "bad_input"
    assert needle in error["message"]
    assert gw.scheduler.requests == []


async def test_body_that_is_not_json_is_a_400(gw: GenGateway) -> None:
    resp = await gw.client.post("/v1/completions", data=b"{nope")
    assert resp.status == 400
    assert "not valid JSON" in (await resp.json())["error"]["message"]


async def test_unknown_model_is_404_and_non_generation_model_too(
    make_gen_gateway: MakeGenGateway,
) -> None:
    gw = await make_gen_gateway(tiny_llm(), servable("matmul", 1, MATMUL_METHODS))
    for model, needle in (("nope", "unknown model 'nope'"), ("matmul", "not a text-generation")):
        resp = await gw.client.post("/v1/completions", json={"model": model, "prompt": "x"})
        assert resp.status == 404
        error = (await resp.json())["error"]
        assert needle in error["message"] and error["code"] == "not_found"


async def test_unready_model_is_503_with_retry_after(make_gen_gateway: MakeGenGateway) -> None:
    gw = await make_gen_gateway(tiny_llm(ready=False, reason="rank 1 lost"))
    resp = await gw.client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "1"
    assert "rank 1 lost" in (await resp.json())["error"]["message"]


async def test_error_as_first_chunk_keeps_its_status_even_when_streaming(
    make_gen_gateway: MakeGenGateway,
) -> None:
    full = [error_chunk(0, ErrorCode.OVERLOADED, "waiting queue is full (256)")]
    too_long = [error_chunk(0, ErrorCode.BAD_INPUT, "prompt + max_tokens exceed 128")]
    for script, status in ((full, 503), (too_long, 400)):
        gw = await make_gen_gateway(script=lambda r, s=script: s)  # type: ignore[misc]
        for stream in (False, True):
            body = {"model": "tiny", "prompt": "x", "stream": stream}
            resp = await gw.client.post("/v1/completions", json=body)
            assert resp.status == status
            assert (await resp.json())["error"]["message"] == script[0].error.message  # type: ignore[union-attr]


async def test_error_after_the_stream_started_is_a_last_error_event_without_done(
    make_gen_gateway: MakeGenGateway,
) -> None:
    def lost(request: GenerateRequest) -> list[object]:
        return [
            *chunks_of(["Hel", "lo", "!"])[:2],
            error_chunk(2, ErrorCode.RANK_LOST, "rank 1 lost"),
        ]

    gw = await make_gen_gateway(script=lost)  # type: ignore[arg-type]
    body = {"model": "tiny", "prompt": "x", "stream": True}
    resp = await gw.client.post("/v1/completions", json=body)
    assert resp.status == 200
    events = sse_events(await resp.text())
    assert "[DONE]" not in events
    assert json.loads(events[-1]) == {
        "error": {
            "message": "rank 1 lost",
            "type": "service_unavailable",
            "param": None,
            "code": "rank_lost",
        }
    }
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["Hel", "lo"]


async def test_non_streamed_error_after_some_text_is_the_error(
    make_gen_gateway: MakeGenGateway,
) -> None:
    def lost(request: GenerateRequest) -> list[object]:
        return [chunks_of(["a", "b"])[0], error_chunk(1, ErrorCode.INTERNAL, "step failed")]

    gw = await make_gen_gateway(script=lost)  # type: ignore[arg-type]
    resp = await gw.client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert resp.status == 500
    assert (await resp.json())["error"]["message"] == "step failed"


async def test_models_lists_the_generation_servables(make_gen_gateway: MakeGenGateway) -> None:
    gw = await make_gen_gateway(
        tiny_llm(), servable("tiny", 2, (), generation=True), servable("matmul", 1, MATMUL_METHODS)
    )
    resp = await gw.client.get("/v1/models")
    assert resp.status == 200
    assert await resp.json() == {
        "object": "list",
        "data": [{"id": "tiny", "object": "model", "created": 0, "owned_by": "shardserve"}],
    }


async def test_models_is_503_without_a_fresh_status(gw: GenGateway) -> None:
    gw.clock.advance(60)
    resp = await gw.client.get("/v1/models")
    assert resp.status == 503
    assert "stale" in (await resp.json())["error"]["message"]
