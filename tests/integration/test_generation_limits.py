"""Issue 36, "limits agree end to end", on a real mesh (`shardserve up` on the exported
llama fixture, gateway, scheduler and agent over real RabbitMQ): every generation entry
refuses at once what the wire's bounds (``shardserve.wire.bounds``, the scheduler's decoder
limits) refuse, a 400 naming the limit (OpenAI's error shape on /v1), and nothing reaches
the dead-letter queue; a queue-level GenerateRequest past those bounds, which only the
scheduler's decoder sees, gets a one-chunk ``bad_input`` stream naming the limit.

Before: a ``logit_bias`` token id >= 2**64 passed the gateway's checks and failed to encode
(a 500); a queue-level request past a limit was dead-lettered and its sender got nothing
(it waited for its deadline)."""

from __future__ import annotations

import asyncio
import io
import json
import math
import queue
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp
import msgpack
import numpy as np
import pytest
import requests
import tritonclient.grpc as triton

from shardserve.errors import ErrorCode
from shardserve.ops.child_mesh import LocalMesh
from shardserve.text.token_bound import most_bytes_per_token, prompt_bytes_limit
from shardserve.wire import codec, topology
from shardserve.wire.bounds import MAX_ARRAY_ITEMS, MAX_PROMPT_BYTES, MAX_STR_BYTES, MAX_TOKEN_ID
from shardserve.wire.protocol import GenerateChunk

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation_http import FIXTURE, fixture_mesh

pytestmark = pytest.mark.integration

SERVABLE = "llama"
WAIT_S = 120.0  # a bound for a failing test; every answer here comes at once
TOO_LONG = "x" * 2_000_000
HALF = "x" * (MAX_PROMPT_BYTES // 2 + 1)  # two of them: past the prompt's limit together
IDS = list(range(1_100_000))  # past the decoder's array limit


def context_bytes_limit() -> int:
    """The fixture's text prompt limit: its context (128) at its tokenizer's byte bound."""
    per_token = most_bytes_per_token(json.loads((FIXTURE / "tokenizer.json").read_text()))
    context = json.loads((FIXTURE / "config.json").read_text())["max_position_embeddings"]
    assert per_token is not None
    return prompt_bytes_limit(context, per_token)


CONTEXT_BYTES = context_bytes_limit()
PAST_CONTEXT = "x" * (CONTEXT_BYTES + 1)  # within the wire's limit, surely past the context


@pytest.fixture(scope="module")
def mesh(isolated_amqp_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    with fixture_mesh(isolated_amqp_url, tmp_path_factory, SERVABLE, rank_size=1) as mesh:
        yield mesh


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": SERVABLE, "prompt": "hi", "max_tokens": 2, **fields}


def chat(*contents: str) -> dict[str, Any]:
    return {"model": SERVABLE, "messages": [{"role": "user", "content": c} for c in contents]}


GENERATE = f"/v2/models/{SERVABLE}/generate"
# A body past 6 x the servable's prompt limit + 256 KiB is refused from its length, before
# it is read (413); what fits is parsed and checked field by field (400).
BODY_LIMIT = "prompt byte limit"
# (route, body, status, words the error names)
HTTP_CASES = [
    ("/v1/completions", completion(prompt=TOO_LONG), 413, BODY_LIMIT),
    ("/v1/completions", completion(prompt=IDS), 413, BODY_LIMIT),
    ("/v1/completions", completion(stop=["a"] * 17), 400, "at most 16"),
    ("/v1/completions", completion(stop=["a" * 300]), 400, "at most 256"),
    ("/v1/completions", completion(logit_bias={str(2**64): 1}), 400, str(MAX_TOKEN_ID)),
    ("/v1/chat/completions", chat(TOO_LONG), 413, BODY_LIMIT),
    ("/v1/chat/completions", chat(HALF, HALF), 413, BODY_LIMIT),
    ("/v1/chat/completions", chat(*["hi"] * 5000), 400, "at most 4096"),
    (GENERATE, {"text_input": TOO_LONG}, 413, BODY_LIMIT),
    (GENERATE + "_stream", {"text_input": TOO_LONG}, 413, BODY_LIMIT),
    (GENERATE, {"text_input": "hi", "stop": ["a"] * 17}, 400, "at most 16"),
    # the servable's own bound (its status): refused by the gateway, not published
    ("/v1/completions", completion(prompt=PAST_CONTEXT), 400, f"takes at most {CONTEXT_BYTES}"),
    (GENERATE, {"text_input": PAST_CONTEXT}, 400, f"takes at most {CONTEXT_BYTES}"),
    (GENERATE + "_stream", {"text_input": PAST_CONTEXT}, 400, f"takes at most {CONTEXT_BYTES}"),
]


def error_text(path: str, body: dict[str, Any]) -> str:
    if path.startswith("/v1/"):  # OpenAI's shape
        assert set(body["error"]) >= {"message", "type", "param", "code"}
        return str(body["error"]["message"])
    return str(body["error"])


async def dead_letters(amqp_url: str) -> int:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        dead = await channel.get_queue(topology.DEAD_LETTER_QUEUE, ensure=True)
        await dead.declare()  # (passive: the count now)
        return int(dead.declaration_result.message_count or 0)


async def test_every_http_entry_refuses_what_the_wire_would_at_once(
    mesh: LocalMesh, isolated_amqp_url: str
) -> None:
    # A generous deadline: a request that were published would hold the client for it.
    headers = {"Content-Type": "application/json", "X-Request-Timeout": "600"}
    timeout = aiohttp.ClientTimeout(total=WAIT_S)
    before = await dead_letters(isolated_amqp_url)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for path, body, status, words in HTTP_CASES:
            raw = io.BytesIO(json.dumps(body).encode())  # (aiohttp streams a file-like body)
            async with session.post(mesh.http_url + path, data=raw, headers=headers) as resp:
                assert resp.status == status, (path, await resp.text())
                assert words in error_text(path, await resp.json()), path
        # Requests reach the scheduler in order: once this one is answered, anything sent
        # before it has been read (and a bad one dead-lettered).
        good = completion(prompt="Hello", max_tokens=2)
        async with session.post(mesh.http_url + "/v1/completions", json=good) as resp:
            assert resp.status == 200, await resp.text()
    assert await dead_letters(isolated_amqp_url) == before


def test_grpc_stream_infer_refuses_a_prompt_past_the_limit(mesh: LocalMesh) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    prompt = triton.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([TOO_LONG.encode()], dtype=object))
    with triton.InferenceServerClient(f"127.0.0.1:{mesh.grpc_port}") as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer(SERVABLE, [prompt], parameters={"max_tokens": 2})
        _, error = answers.get(timeout=WAIT_S)
        client.stop_stream()
    assert error is not None and f"limit of {MAX_PROMPT_BYTES}" in str(error)


def queue_request(**fields: Any) -> dict[str, Any]:
    """A GenerateRequest body as a queue-level client writes it (no pydantic in between)."""
    return {
        "v": codec.SCHEMA_VERSION,
        "kind": "generate.request",
        "id": "limits",
        "servable": SERVABLE,
        "version": 0,
        "sampling": {"max_tokens": 2},
        "deadline": time.time() + 600,
        **fields,
    }


# (body fields, words the error names): each one past a bound only the scheduler sees here
QUEUE_CASES = [
    (
        {"prompt": TOO_LONG},
        f"a string of 2000000 bytes exceeds the wire's limit of {MAX_STR_BYTES}",
    ),
    (
        {"prompt_ids": IDS},
        f"an array of 1100000 items exceeds the wire's limit of {MAX_ARRAY_ITEMS}",
    ),
    (
        {"messages": [{"role": "user", "content": HALF}] * 2},
        f"exceeds the limit of {MAX_PROMPT_BYTES}",
    ),
    ({"prompt": "hi", "deadline": math.nan}, "deadline"),
    ({"prompt": "hi", "sampling": {"stop_token_ids": [2**40]}}, str(MAX_TOKEN_ID)),
]


@pytest.fixture
async def replies(isolated_amqp_url: str) -> AsyncIterator[tuple[Any, Any]]:
    """A channel and an exclusive reply queue, as a queue-level client has them."""
    connection = await aio_pika.connect(isolated_amqp_url)
    async with connection:
        channel = await connection.channel()
        yield channel, await channel.declare_queue(exclusive=True, auto_delete=True)


async def test_a_queue_level_request_past_a_limit_gets_an_error_chunk_naming_it(
    mesh: LocalMesh, replies: tuple[Any, Any]
) -> None:
    channel, reply_queue = replies
    exchange = await channel.get_exchange(topology.REQUESTS_EXCHANGE)
    sent = {}
    for fields, words in QUEUE_CASES:
        correlation_id = uuid.uuid4().hex
        sent[correlation_id] = words
        body = msgpack.packb(queue_request(**fields), use_bin_type=True)
        message = aio_pika.Message(
            body,
            reply_to=reply_queue.name,
            correlation_id=correlation_id,
            type="generate.request",
            content_type=codec.CONTENT_TYPE,
        )
        await exchange.publish(message, routing_key=SERVABLE)
    answered: dict[str, GenerateChunk] = {}
    async with reply_queue.iterator() as incoming:
        while len(answered) < len(sent):
            delivery = await asyncio.wait_for(anext(incoming), WAIT_S)
            await delivery.ack()
            chunk = codec.decode_as(delivery.body, GenerateChunk)
            assert delivery.correlation_id not in answered  # one chunk per stream
            answered[str(delivery.correlation_id)] = chunk
    for correlation_id, words in sent.items():
        chunk = answered[correlation_id]
        assert chunk.seq == 0 and chunk.error is not None, chunk
        assert chunk.error.code == ErrorCode.BAD_INPUT and words in chunk.error.message, chunk


def test_a_prompt_at_the_context_bound_goes_to_the_scheduler(mesh: LocalMesh) -> None:
    """The gateway refuses no more than the scheduler would: at the bound itself the prompt
    is published, tokenized and refused there for its token count."""
    body = completion(prompt="x" * CONTEXT_BYTES)
    answer = requests.post(mesh.http_url + "/v1/completions", json=body, timeout=WAIT_S)
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert "takes at most" not in message and "context" in message, message
