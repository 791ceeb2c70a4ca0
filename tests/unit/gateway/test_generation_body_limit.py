"""Issue 36, "no request may slow another": a generation body far past what its servable's
prompt limit allows is refused with a 413 naming the limit before it is read whole (from
its Content-Length, or once that many bytes of a chunked body have arrived) and nothing is
published. Before: every generation body up to --max-body-mb (64 MiB) was read and parsed
on the gateway's event loop, which also forwards every other stream's tokens."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator

import pytest
from generation_fakes import MakeGenGateway, gen_gateways, tiny_llm

from shardserve_gateway.generation.body_limit import (
    ESCAPED_BYTES_PER_BYTE,
    SLACK_BYTES,
    body_limit,
)

PROMPT_LIMIT = 1000
LIMIT = ESCAPED_BYTES_PER_BYTE * PROMPT_LIMIT + SLACK_BYTES
JSON = {"Content-Type": "application/json"}
MAX_BODY = 64 * 1024 * 1024


def test_the_body_limit_is_the_largest_escaped_prompt_plus_slack() -> None:
    small, large = tiny_llm(prompt_bytes_limit=10), tiny_llm(prompt_bytes_limit=PROMPT_LIMIT)
    assert body_limit([small, large], MAX_BODY) == LIMIT
    assert body_limit([large], LIMIT - 1) == LIMIT - 1  # never above --max-body-mb


def test_without_a_prompt_limit_bodies_keep_the_gateways_limit() -> None:
    bounded, unbounded = tiny_llm(prompt_bytes_limit=PROMPT_LIMIT), tiny_llm()
    assert body_limit([bounded, unbounded], MAX_BODY) == MAX_BODY
    assert body_limit([], MAX_BODY) == MAX_BODY


def test_the_fully_escaped_largest_prompt_fits_the_limit() -> None:
    prompt = "\x00" * PROMPT_LIMIT  # each byte escaped as \u0000: the worst case
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4, "stop": ["a" * 256]})
    assert len(body) <= LIMIT


@pytest.fixture
async def make() -> AsyncIterator[MakeGenGateway]:
    async with gen_gateways() as maker:
        yield maker


ROUTES = ["/v1/completions", "/v1/chat/completions", "/v2/models/tiny/generate"]


def padded(path: str, size: int) -> bytes:
    """A well-formed body of ``size`` bytes whose prompt is within the limit (whitespace)."""
    body = {"text_input": "hi"} if path.startswith("/v2") else {"model": "tiny", "prompt": "hi"}
    if path == "/v1/chat/completions":
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    raw = json.dumps(body).encode()
    return raw[:-1] + b" " * (size - len(raw)) + b"}"


@pytest.mark.parametrize("path", ROUTES)
async def test_a_body_past_the_limit_is_a_413_naming_it(make: MakeGenGateway, path: str) -> None:
    gateway = await make(tiny_llm(prompt_bytes_limit=PROMPT_LIMIT))
    resp = await gateway.client.post(path, data=padded(path, LIMIT + 1), headers=JSON)
    assert resp.status == 413, await resp.text()
    assert f"limit of {LIMIT} bytes" in await resp.text()
    assert "prompt byte limit" in await resp.text()
    assert gateway.scheduler.requests == []


@pytest.mark.parametrize("path", ROUTES)
async def test_a_body_at_the_limit_is_served(make: MakeGenGateway, path: str) -> None:
    gateway = await make(tiny_llm(prompt_bytes_limit=PROMPT_LIMIT))
    resp = await gateway.client.post(path, data=padded(path, LIMIT), headers=JSON)
    assert resp.status == 200, await resp.text()


async def test_a_chunked_body_is_refused_once_past_the_limit_not_read_to_its_end(
    make: MakeGenGateway,
) -> None:
    gateway = await make(tiny_llm(prompt_bytes_limit=PROMPT_LIMIT))
    sent = 0

    async def endless() -> AsyncIterator[bytes]:  # a body that never ends
        nonlocal sent
        yield b'{"model": "tiny", "prompt": "'
        while True:
            sent += 64 * 1024
            yield b"x" * (64 * 1024)

    resp = await gateway.client.post("/v1/completions", data=endless(), headers=JSON)
    assert resp.status == 413, await resp.text()
    assert f"limit of {LIMIT} bytes" in await resp.text()
    assert gateway.scheduler.requests == []
    assert sent < 64 * LIMIT


async def test_a_triton_route_takes_its_own_models_limit(make: MakeGenGateway) -> None:
    big = tiny_llm(prompt_bytes_limit=100 * PROMPT_LIMIT).model_copy(update={"name": "big"})
    gateway = await make(tiny_llm(prompt_bytes_limit=PROMPT_LIMIT), big)
    body = padded("/v2", LIMIT + 1)
    small_resp = await gateway.client.post("/v2/models/tiny/generate", data=body, headers=JSON)
    big_resp = await gateway.client.post("/v2/models/big/generate", data=body, headers=JSON)
    assert (small_resp.status, big_resp.status) == (413, 200), await big_resp.text()


async def test_an_openai_body_takes_the_largest_limit_of_every_model(
    make: MakeGenGateway,
) -> None:
    big = tiny_llm(prompt_bytes_limit=100 * PROMPT_LIMIT).model_copy(update={"name": "big"})
    gateway = await make(tiny_llm(prompt_bytes_limit=PROMPT_LIMIT), big)
    resp = await gateway.client.post(
        "/v1/completions", data=io.BytesIO(padded("/v1/completions", LIMIT + 1)), headers=JSON
    )
    # the body names its model inside: bounded by the largest, then served
    assert resp.status == 200, await resp.text()
