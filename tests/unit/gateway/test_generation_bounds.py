"""Issue 36, defects 4 and 5: what the wire cannot carry or the scheduler's decoder would
dead-letter is refused by the gateway at once, 400 naming the field and the limit, on
every generation route (OpenAI's error shape on /v1), and nothing is published.
Before: integers >= 2**64 and unpaired surrogates were published and failed to encode
(500), 100,000 nested "[" escaped the JSON parser (500), a 2 MB prompt was published
and dead-lettered by the scheduler's decoder (the client waited for its deadline)."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from generation_fakes import GenGateway, MakeGenGateway, gen_gateways

from shardserve.wire.bounds import MAX_PROMPT_BYTES

HUGE = 2**64
LONE = "\ud800"
TOO_LONG = "x" * (MAX_PROMPT_BYTES + 1)


@pytest.fixture
async def gateway() -> AsyncIterator[GenGateway]:
    make: MakeGenGateway
    async with gen_gateways() as make:
        yield await make()


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 4, **fields}


def chat(content: str = "hi", **fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **fields}


def triton(text: str = "hi", **parameters: Any) -> dict[str, Any]:
    return {"text_input": text, "parameters": parameters}


CASES = [
    ("/v1/completions", completion(top_k=HUGE), "top_k", "less than or equal to 2147483647"),
    ("/v1/completions", completion(stop_token_ids=[HUGE]), "stop_token_ids", "2147483647"),
    ("/v1/completions", completion(prompt=[1, HUGE]), "prompt_ids", "2147483647"),
    ("/v1/completions", completion(prompt=LONE), "prompt", "unpaired surrogate"),
    ("/v1/completions", completion(stop=[LONE]), "stop", "unpaired surrogate"),
    ("/v1/completions", completion(logit_bias={str(HUGE): 1}), "logit_bias", "2147483647"),
    ("/v1/completions", completion(prompt=TOO_LONG), "prompt", f"limit of {MAX_PROMPT_BYTES}"),
    ("/v1/chat/completions", chat(LONE), "content", "unpaired surrogate"),
    ("/v1/chat/completions", chat(TOO_LONG), "content", f"limit of {MAX_PROMPT_BYTES}"),
    ("/v1/chat/completions", chat(top_k=HUGE), "top_k", "2147483647"),
    ("/v2/models/tiny/generate", triton(LONE), "prompt", "unpaired surrogate"),
    ("/v2/models/tiny/generate", triton(top_k=HUGE), "top_k", "2147483647"),
    ("/v2/models/tiny/generate_stream", triton(stop_token_ids=[HUGE]), "stop_token_ids", "2147"),
    ("/v2/models/tiny/generate_stream", triton(TOO_LONG), "prompt", str(MAX_PROMPT_BYTES)),
]


def error_text(path: str, body: dict[str, Any]) -> str:
    if path.startswith("/v1/"):  # OpenAI's shape
        assert set(body["error"]) >= {"message", "type", "param", "code"}
        return str(body["error"]["message"])
    return str(body["error"])


@pytest.mark.parametrize(("path", "body", "field", "limit"), CASES)
async def test_values_the_wire_cannot_carry_are_400s_naming_the_field(
    gateway: GenGateway, path: str, body: dict[str, Any], field: str, limit: str
) -> None:
    # a body past 1 MiB goes as a stream (aiohttp warns about one sent as bytes)
    raw = io.BytesIO(json.dumps(body).encode())
    resp = await gateway.client.post(path, data=raw, headers={"Content-Type": "application/json"})
    assert resp.status == 400, await resp.text()
    message = error_text(path, await resp.json())
    assert field in message and limit in message
    assert gateway.scheduler.requests == []


@pytest.mark.parametrize(
    "path",
    ["/v1/completions", "/v1/chat/completions", "/v2/models/tiny/generate"],
)
async def test_deeply_nested_json_is_a_400(gateway: GenGateway, path: str) -> None:
    resp = await gateway.client.post(
        path, data="[" * 100_000, headers={"Content-Type": "application/json"}
    )
    assert resp.status == 400
    assert "nested too deeply" in error_text(path, await resp.json())
