"""The generation routes' answers validate against the OpenAPI document's schemas (the
fuzzing engineer drives schemathesis from it), and the documented requests match."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import jsonschema_rs
import pytest
from generation_fakes import GenGateway, MakeGenGateway, gen_gateways, sse_events

from shardserve_gateway.routes.openapi import document


@pytest.fixture
async def gw() -> AsyncIterator[GenGateway]:
    make: MakeGenGateway
    async with gen_gateways() as make:
        yield await make()


def validate(value: Any, schema: str) -> None:
    spec = json.loads(json.dumps(document()))
    root = {"$ref": f"#/components/schemas/{schema}", "components": spec["components"]}
    jsonschema_rs.Draft202012Validator(root).validate(value)


async def post(gw: GenGateway, path: str, body: dict[str, Any]) -> Any:
    return await (await gw.client.post(path, json=body)).json()


async def test_answers_match_the_documented_schemas(gw: GenGateway) -> None:
    completion = {"model": "tiny", "prompt": "x", "max_tokens": 3}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    generate = {"text_input": "x", "parameters": {"max_tokens": 3}}
    validate(completion, "completion_request")
    validate(chat, "chat_request")
    validate(generate, "generate_request")
    validate(await post(gw, "/v1/completions", completion), "completion")
    validate(await post(gw, "/v1/chat/completions", chat), "chat_completion")
    validate(await post(gw, "/v2/models/tiny/generate", generate), "generate_response")
    validate(await (await gw.client.get("/v1/models")).json(), "openai_models")
    validate(await post(gw, "/v1/completions", {"model": "nope", "prompt": "x"}), "openai_error")
    validate(await post(gw, "/v2/models/nope/generate", generate), "error")
    resp = await gw.client.post("/v1/chat/completions", json={**chat, "stream": True})
    for data in sse_events(await resp.text())[:-1]:
        validate(json.loads(data), "chat_completion")


def test_the_documented_triton_request_refuses_unknown_fields() -> None:
    with pytest.raises(jsonschema_rs.ValidationError):
        validate({"text_input": "x", "parameters": {"beam_width": 2}}, "generate_request")
