"""The committed AsyncAPI document is exactly what the generator builds from the models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from shardserve.client.asyncapi import build_asyncapi, main
from shardserve.errors import ErrorCode
from shardserve.wire.protocol import (
    GenerateCancel,
    GenerateChunk,
    GenerateRequest,
    InferReply,
    InferReplyBundle,
    InferRequest,
    InferRequestBundle,
    InstanceResult,
)

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "asyncapi.yaml"
REGENERATE = "python -m shardserve.client.asyncapi docs/asyncapi.yaml"


def test_committed_yaml_matches_the_generator() -> None:
    committed = yaml.safe_load(COMMITTED.read_text(encoding="utf-8"))
    assert committed == build_asyncapi(), f"docs/asyncapi.yaml is stale: run {REGENERATE}"


def test_committed_yaml_is_byte_identical_to_a_fresh_run(tmp_path: Path) -> None:
    fresh = tmp_path / "asyncapi.yaml"
    assert main([str(fresh)]) == 0
    assert fresh.read_text(encoding="utf-8") == COMMITTED.read_text(encoding="utf-8"), REGENERATE


def test_every_reference_resolves() -> None:
    document = build_asyncapi()
    refs = list(_refs(document))
    assert len(refs) > 10
    for ref in refs:
        assert ref.startswith("#/"), ref
        node: Any = document
        for part in ref[2:].split("/"):
            assert isinstance(node, dict) and part in node, f"dangling $ref {ref}"
            node = node[part]


def _refs(node: Any) -> Any:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def test_payload_schemas_cover_the_public_models() -> None:
    schemas = build_asyncapi()["components"]["schemas"]
    assert {"InferRequest", "InferReply", "Tensor", "ErrorInfo", "InstanceResult"} <= set(schemas)
    for model in (InferRequest, InferReply, InstanceResult, InferRequestBundle, InferReplyBundle):
        assert set(schemas[model.__name__]["properties"]) == set(model.model_fields)
    assert schemas["InferRequest"]["properties"]["kind"]["const"] == "infer.request"
    assert schemas["InferRequest"]["additionalProperties"] is False


def test_every_error_code_is_listed_and_explained() -> None:
    error_code = build_asyncapi()["components"]["schemas"]["ErrorCode"]
    assert error_code["enum"] == [c.value for c in ErrorCode]
    for code in ErrorCode:
        assert f"- `{code.value}` (" in error_code["description"]


def test_channels_name_the_request_exchange_and_the_reply_queue() -> None:
    channels = build_asyncapi()["channels"]
    request = channels["shardserve.requests/{servable}"]
    assert request["bindings"]["amqp"]["exchange"]["name"] == "shardserve.requests"
    assert request["bindings"]["amqp"]["exchange"]["type"] == "topic"
    sent = [m["$ref"] for m in request["publish"]["message"]["oneOf"]]
    assert sent == [
        "#/components/messages/InferRequest",
        "#/components/messages/InferRequestBundle",
        "#/components/messages/GenerateRequest",
        "#/components/messages/GenerateCancel",
    ]
    received = [m["$ref"] for m in channels["{reply_to}"]["subscribe"]["message"]["oneOf"]]
    assert received == [
        "#/components/messages/InferReply",
        "#/components/messages/InferReplyBundle",
        "#/components/messages/GenerateChunk",
    ]


def test_generation_messages_are_documented_from_their_models() -> None:
    document = build_asyncapi()
    schemas, messages = document["components"]["schemas"], document["components"]["messages"]
    for model in (GenerateRequest, GenerateCancel, GenerateChunk):
        assert set(schemas[model.__name__]["properties"]) == set(model.model_fields)
        kind = model.model_fields["kind"].default
        assert schemas[model.__name__]["properties"]["kind"]["const"] == kind
        assert messages[model.__name__]["bindings"]["amqp"]["messageType"] == kind
    assert {"SamplingParams", "ChatMessage", "Usage", "TokenLogprob"} <= set(schemas)
    assert "numbered by `seq` from 0" in schemas["GenerateRequest"]["description"]
    assert "`cancelled`" in schemas["GenerateCancel"]["description"]
