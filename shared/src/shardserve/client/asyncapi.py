"""The queue-level API as an AsyncAPI 2.6 document, built from the wire models.

``build_asyncapi()`` returns the document as a dict; the message payload schemas come
from the pydantic models (``InferRequest``, ``InferReply``, ``Tensor``, ``ErrorInfo``,
``InstanceResult``; for generation ``GenerateRequest``, ``GenerateCancel``,
``GenerateChunk``) so the committed ``docs/asyncapi.yaml`` cannot drift from the code
(a unit test compares them). Regenerate with::

    python -m shardserve.client.asyncapi docs/asyncapi.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pydantic.json_schema import models_json_schema

from shardserve import __version__
from shardserve.errors import ErrorCode, http_status
from shardserve.wire import topology
from shardserve.wire.codec import CONTENT_TYPE
from shardserve.wire.protocol import (
    SCHEMA_VERSION,
    GenerateCancel,
    GenerateChunk,
    GenerateRequest,
    InferReply,
    InferReplyBundle,
    InferRequest,
    InferRequestBundle,
)
from shardserve.wire.tensors import BYTES_DTYPE, DTYPE_TO_DATATYPE

ASYNCAPI_VERSION = "2.6.0"
AMQP_BINDING_VERSION = "0.2.0"
REF = "#/components/schemas/{model}"

ERROR_MEANINGS: dict[ErrorCode, str] = {
    ErrorCode.BAD_INPUT: "the inputs do not fit the method: missing or extra inputs, wrong "
    "datatype or shape. Fix the request; do not retry it as is.",
    ErrorCode.NOT_FOUND: "no such servable, version or method.",
    ErrorCode.UNAVAILABLE: "the servable's group is not ready (ranks missing or loading) or "
    "the scheduler is draining. Retry later.",
    ErrorCode.OVERLOADED: "too many requests in flight. Retry with backoff.",
    ErrorCode.DEADLINE: "the deadline passed before the result was ready.",
    ErrorCode.INTERNAL: "an unexpected failure inside the mesh.",
    ErrorCode.RANK_MISMATCH: "the ranks of a stage produced different results (their output "
    "digests disagree); the message names the ranks.",
    ErrorCode.RANK_LOST: "a rank stopped heartbeating while the request was in flight. "
    "Retry once the group has healed.",
    ErrorCode.STAGE_FAILED: "a rank failed to run its stage (the message says why).",
    ErrorCode.CANCELLED: "the caller cancelled the generation (GenerateCancel); its stream "
    "ends with this error.",
}

TENSOR_LAYOUT = (
    "A tensor: `dtype` is numpy's dtype string (little-endian), `shape` the dimensions, "
    "`data` the raw bytes (msgpack bin), row-major, no padding. String tensors (KServe "
    f"BYTES) use dtype `{BYTES_DTYPE}`: each element is a 4-byte little-endian unsigned "
    "length followed by that many bytes. Datatypes: "
    + ", ".join(f"`{d}` = {k}" for d, k in DTYPE_TO_DATATYPE.items())
    + "."
)

REQUEST_DESCRIPTION = (
    "One call of a servable's method. `instances` is a list of instances (MindSpore "
    "Serving style), each a map of input name to Tensor; replies keep this order. "
    "`version` 0 means the highest ready version. `deadline` is absolute (unix seconds, "
    "float): past it the request ends with `deadline_exceeded`. `id` is your own label "
    "(echoed in the reply, need not be unique). Set the AMQP properties `reply_to` (your "
    "queue) and `correlation_id` (unique per request); set `expiration` (milliseconds "
    "until the deadline) so that a request nobody takes in time dies in the queue (it is "
    "then dead-lettered and NO reply comes: your own timeout covers it)."
)

REPLY_DESCRIPTION = (
    "The single outcome of one InferRequest, published to its `reply_to` queue with its "
    "`correlation_id`. Either `error` is set (the whole request failed, `instances` is "
    "empty) or `instances` holds one InstanceResult per request instance, in order, each "
    "with `outputs` or its own `error`."
)


GENERATE_DESCRIPTION = (
    "Generate text with a text-generation servable (one exported by `shardserve export hf`). "
    "Give exactly one of `prompt` (text, tokenized with the servable's tokenizer), "
    "`prompt_ids` (token ids) or `messages` (a chat, rendered with the checkpoint's chat "
    "template). Set the AMQP properties `reply_to` and `correlation_id` as for an "
    "InferRequest: the answer is a stream of GenerateChunk messages to `reply_to`, each "
    "with your `correlation_id`, numbered by `seq` from 0; the last one has "
    "`finish_reason` and `usage`, or `error`. A request refused up front (unknown "
    "servable, prompt too long for the context or the KV cache: `bad_input`; waiting "
    "queue full: `overloaded` with `retry_after_s`) is a stream of one chunk with "
    "`error`. Past `deadline` the stream ends with `deadline_exceeded`."
)

CANCEL_DESCRIPTION = (
    "Stop a running generation: name its `reply_to` queue and `correlation_id`. Publish "
    "it like the request (same exchange, same routing key) so it cannot overtake it. The "
    "sequence leaves the mesh within one step, its KV cache is freed on every rank, and "
    "its stream ends with a chunk whose `error.code` is `cancelled`. A cancel of a "
    "generation that already ended is ignored."
)

CHUNK_DESCRIPTION = (
    "One message of a generation's stream. `seq` counts from 0 with no gap (a gap or a "
    "repeat means a lost or duplicated message). `token_ids` are the new tokens and "
    "`text` their text (it may be empty while the bytes of a character or a possible "
    "stop string are held back; the texts joined are the whole text). Exactly one chunk "
    "is last: it has `finish_reason` (`stop`: an EOS, stop token or stop string; "
    "`length`: `max_tokens` or the model's context) and `usage`, or `error`."
)


def build_asyncapi() -> dict[str, Any]:
    """Return the AsyncAPI 2.6 document of the public queue-level API."""
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "id": "urn:shardserve:queue-api",
        "info": _info(),
        "servers": _servers(),
        "defaultContentType": CONTENT_TYPE,
        "channels": {
            "shardserve.requests/{servable}": _request_channel(),
            "{reply_to}": _reply_channel(),
        },
        "components": {
            "messages": _messages(),
            "schemas": _schemas(),
            "correlationIds": {
                "requestCorrelation": {
                    "description": "The AMQP correlation_id property: the reply carries the "
                    "request's value unchanged.",
                    "location": "$message.header#/correlation_id",
                }
            },
        },
    }


def _info() -> dict[str, Any]:
    return {
        "title": "shardserve queue-level inference API",
        "version": __version__,
        "description": (
            "Publish an InferRequest to the topic exchange `shardserve.requests` with "
            "routing key = servable name; the scheduler answers one InferReply to your "
            "`reply_to` queue with your `correlation_id`. A GenerateRequest (text "
            "generation) is published the same way and answered with a stream of "
            "GenerateChunk messages numbered from 0; a GenerateCancel stops it. Bodies "
            "are msgpack maps (bytes as bin, never ext types). Every message carries "
            f"`v` = {SCHEMA_VERSION} (the schema version) and a `kind`. A body that does not "
            "decode to a valid message "
            "(bad msgpack, wrong `v`, unknown or missing fields) is dead-lettered to "
            "`shardserve.dead` WITHOUT a reply; a valid request whose inputs do not fit the "
            "method gets a `bad_input` reply (the same checks as the HTTP gateway). See "
            "docs/queue-api.md."
        ),
        "license": {"name": "Apache-2.0"},
    }


def _servers() -> dict[str, Any]:
    return {
        "rabbitmq": {
            "url": "amqp://{host}:{port}/",
            "protocol": "amqp",
            "protocolVersion": "0.9.1",
            "description": "The mesh's RabbitMQ (SHARDSERVE_AMQP_URL).",
            "variables": {"host": {"default": "127.0.0.1"}, "port": {"default": "5672"}},
        }
    }


def _request_channel() -> dict[str, Any]:
    return {
        "description": f"Exchange `{topology.REQUESTS_EXCHANGE}` (topic), routing key = "
        f"the servable name; the scheduler's queue `{topology.REQUEST_QUEUE}` (or the "
        f"quorum queue `{topology.QUORUM_REQUEST_QUEUE}` with `--request-queue quorum`; "
        f"bounded to {topology.REQUEST_QUEUE_MAX_LENGTH} messages, publishes refused when "
        "full: use publisher confirms to see it) takes every key.",
        "parameters": {
            "servable": {
                "description": "The routing key: the servable's name.",
                "schema": {"type": "string", "minLength": 1, "maxLength": 128},
            }
        },
        "bindings": {
            "amqp": {
                "is": "routingKey",
                "exchange": {
                    "name": topology.REQUESTS_EXCHANGE,
                    "type": "topic",
                    "durable": True,
                    "autoDelete": False,
                    "vhost": "/",
                },
                "bindingVersion": AMQP_BINDING_VERSION,
            }
        },
        "publish": {
            "operationId": "sendInferRequest",
            "summary": "Ask a servable's method to run on some instances (several requests "
            "may travel as one InferRequestBundle), or a text-generation servable to "
            "generate (GenerateRequest; GenerateCancel stops it).",
            "message": {
                "oneOf": [
                    {"$ref": "#/components/messages/InferRequest"},
                    {"$ref": "#/components/messages/InferRequestBundle"},
                    {"$ref": "#/components/messages/GenerateRequest"},
                    {"$ref": "#/components/messages/GenerateCancel"},
                ]
            },
            "bindings": {
                "amqp": {
                    "replyTo": True,
                    "mandatory": True,
                    "deliveryMode": 1,
                    "bindingVersion": AMQP_BINDING_VERSION,
                }
            },
        },
    }


def _reply_channel() -> dict[str, Any]:
    return {
        "description": "Your own reply queue (an exclusive, auto-delete queue is best), "
        "named in the request's `reply_to`; replies come through the default exchange.",
        "parameters": {
            "reply_to": {
                "description": "The queue named in the request's AMQP reply_to property.",
                "schema": {"type": "string"},
            }
        },
        "bindings": {
            "amqp": {
                "is": "queue",
                "queue": {
                    "name": "{reply_to}",
                    "durable": False,
                    "exclusive": True,
                    "autoDelete": True,
                    "vhost": "/",
                },
                "bindingVersion": AMQP_BINDING_VERSION,
            }
        },
        "subscribe": {
            "operationId": "receiveInferReply",
            "summary": "Exactly one reply per InferRequest; a queue that sent an "
            "InferRequestBundle may get several replies in one InferReplyBundle. A "
            "GenerateRequest gets GenerateChunks numbered from 0, the last one with "
            "finish_reason and usage, or error.",
            "message": {
                "oneOf": [
                    {"$ref": "#/components/messages/InferReply"},
                    {"$ref": "#/components/messages/InferReplyBundle"},
                    {"$ref": "#/components/messages/GenerateChunk"},
                ]
            },
        },
    }


def _messages() -> dict[str, Any]:
    return {
        name: {
            "name": name,
            "title": name,
            "summary": summary,
            "contentType": CONTENT_TYPE,
            "correlationId": {"$ref": "#/components/correlationIds/requestCorrelation"},
            "payload": {"$ref": REF.format(model=name)},
            "bindings": {"amqp": {"messageType": kind, "bindingVersion": AMQP_BINDING_VERSION}},
        }
        for name, kind, summary in (
            ("InferRequest", "infer.request", "A request to run one servable method."),
            ("InferReply", "infer.reply", "The outcome of one InferRequest."),
            (
                "InferRequestBundle",
                "infer.request.bundle",
                "Several InferRequests in one message, each with its own correlation id "
                "(the message has none); each is admitted as if it came alone.",
            ),
            (
                "InferReplyBundle",
                "infer.reply.bundle",
                "Several InferReplies in one message, each with its request's correlation "
                "id; sent only to reply queues that have sent an InferRequestBundle.",
            ),
            ("GenerateRequest", "generate.request", "Generate text from a prompt."),
            (
                "GenerateCancel",
                "generate.cancel",
                "Stop a generation (named in the body; the message's own correlation id "
                "is not used).",
            ),
            (
                "GenerateChunk",
                "generate.chunk",
                "One numbered message of a generation's stream.",
            ),
        )
    }


def _schemas() -> dict[str, Any]:
    models = (
        InferRequest,
        InferReply,
        InferRequestBundle,
        InferReplyBundle,
        GenerateRequest,
        GenerateCancel,
        GenerateChunk,
    )
    _, top = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    schemas: dict[str, Any] = top["$defs"]
    schemas["InferRequest"]["description"] = REQUEST_DESCRIPTION
    schemas["InferReply"]["description"] = REPLY_DESCRIPTION
    schemas["GenerateRequest"]["description"] = GENERATE_DESCRIPTION
    schemas["GenerateCancel"]["description"] = CANCEL_DESCRIPTION
    schemas["GenerateChunk"]["description"] = CHUNK_DESCRIPTION
    _describe_generate_fields(schemas["GenerateRequest"]["properties"])
    _describe_request_fields(schemas["InferRequest"]["properties"])
    _describe_tensor(schemas["Tensor"])
    schemas["ErrorCode"]["description"] = _error_code_description()
    return schemas


def _describe_request_fields(properties: dict[str, Any]) -> None:
    properties["v"]["description"] = "Schema version; must be 1."
    properties["id"]["description"] = "Your label for the request, echoed in the reply."
    properties["servable"]["description"] = "The servable's name (also the routing key)."
    properties["version"]["description"] = "Servable version; 0 = the highest ready one."
    properties["method"]["description"] = "The servable method to run."
    properties["outputs"]["description"] = "Names of the outputs wanted; null = all."
    properties["deadline"]["description"] = "Absolute deadline, unix time in seconds."


def _describe_generate_fields(properties: dict[str, Any]) -> None:
    properties["v"]["description"] = "Schema version; must be 1."
    properties["id"]["description"] = "Your label for the request, echoed in every chunk."
    properties["servable"]["description"] = "The servable's name (also the routing key)."
    properties["version"]["description"] = "Servable version; 0 = the highest ready one."
    properties["prompt"]["description"] = "Prompt text (tokenized with special tokens, e.g. BOS)."
    properties["prompt_ids"]["description"] = "Prompt token ids, used as they are."
    properties["messages"]["description"] = "A chat, rendered with the chat template."
    properties["sampling"]["description"] = "How tokens are chosen and when to stop."
    properties["deadline"]["description"] = "Absolute deadline, unix time in seconds."


def _describe_tensor(schema: dict[str, Any]) -> None:
    schema["description"] = TENSOR_LAYOUT
    properties = schema["properties"]
    properties["dtype"]["enum"] = list(DTYPE_TO_DATATYPE)
    properties["dtype"]["description"] = "numpy dtype string, or `bytes` for BYTES tensors."
    properties["shape"]["description"] = "Dimensions (at most 16, each >= 0); [] = scalar."
    properties["data"]["description"] = "Raw little-endian bytes (msgpack bin)."


def _error_code_description() -> str:
    lines = ["Why a request or an instance failed (HTTP status the gateway would use):"]
    lines += [f"- `{c.value}` ({http_status(c)}): {ERROR_MEANINGS[c]}" for c in ErrorCode]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Write the document as YAML to the path given (stdout without one)."""
    import yaml  # a dev dependency, needed only to regenerate the committed file

    args = sys.argv[1:] if argv is None else argv
    text = (
        "# Generated by `python -m shardserve.client.asyncapi docs/asyncapi.yaml`; do not edit.\n"
    )
    text += yaml.safe_dump(build_asyncapi(), sort_keys=False, allow_unicode=True, width=100)
    if args:
        Path(args[0]).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
