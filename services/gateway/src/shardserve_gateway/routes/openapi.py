"""The gateway's OpenAPI 3.1 document, served at ``GET /openapi.json``.

Built here as data (no YAML at run time) and kept honest by a test that compares it with
the application's router: every route is documented and every documented path is routed,
with the same methods. Schemas describe the JSON forms; the binary tensor extension
(``application/octet-stream`` with ``Inference-Header-Content-Length``) is described in
prose, as the official Open Inference Protocol document does not cover it either.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from aiohttp import web

import shardserve
from shardserve_gateway.responses import json_response
from shardserve_gateway.routes.openapi_generation import generation_paths, generation_schemas
from shardserve_gateway.routes.openapi_schema import (
    BOOLEAN,
    INTEGER,
    JSON,
    NUMBER,
    PARAMETERS,
    STRING,
    Schema,
    array,
    obj,
    ref,
)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/openapi.json", openapi_json)


async def openapi_json(request: web.Request) -> web.Response:
    return json_response(document())


def _tensor_schemas() -> dict[str, Schema]:
    tensor_data: Schema = {
        "anyOf": [
            array({"$ref": "#/components/schemas/tensor_data"}),
            NUMBER,
            STRING,
            BOOLEAN,
        ]
    }
    shape = array(INTEGER)
    return {
        "tensor_data": tensor_data,
        "metadata_tensor": obj(
            ("name", "datatype", "shape"), name=STRING, datatype=STRING, shape=shape
        ),
        "request_input": obj(
            ("name", "shape", "datatype"),
            name=STRING,
            shape=shape,
            datatype=STRING,
            parameters=PARAMETERS,
            data=ref("tensor_data"),
        ),
        "request_output": obj(("name",), name=STRING, parameters=PARAMETERS),
        "response_output": obj(
            ("name", "shape", "datatype"),
            name=STRING,
            shape=shape,
            datatype=STRING,
            parameters=PARAMETERS,
            data=ref("tensor_data"),
        ),
    }


def _kserve_schemas() -> dict[str, Schema]:
    return {
        "error": obj(
            ("error",),
            error=STRING,
            code={
                "type": "string",
                "description": "shardserve ErrorCode: bad_input, not_found, unavailable, "
                "overloaded, deadline_exceeded, internal, rank_mismatch, rank_lost, "
                "stage_failed",
            },
        ),
        "live": obj(("live",), live=BOOLEAN),
        "ready": obj(("ready",), ready=BOOLEAN),
        "model_ready": obj(("name", "ready"), name=STRING, ready=BOOLEAN),
        "server_metadata": obj(
            ("name", "version", "extensions"), name=STRING, version=STRING, extensions=array(STRING)
        ),
        "model_list": obj(("models",), models=array(STRING)),
        "model_metadata": obj(
            ("name", "platform", "inputs", "outputs"),
            name=STRING,
            versions=array(STRING),
            platform=STRING,
            inputs=array(ref("metadata_tensor")),
            outputs=array(ref("metadata_tensor")),
        ),
        "inference_request": obj(
            ("inputs",),
            id=STRING,
            parameters=PARAMETERS,
            inputs=array(ref("request_input")),
            outputs=array(ref("request_output")),
        ),
        "inference_response": obj(
            ("model_name", "outputs"),
            model_name=STRING,
            model_version=STRING,
            id=STRING,
            parameters=PARAMETERS,
            outputs=array(ref("response_output")),
        ),
    }


def _other_schemas() -> dict[str, Schema]:
    return {
        "repository_index_request": obj(ready=BOOLEAN),
        "repository_index": array(
            obj(
                ("name", "state"),
                name=STRING,
                version=STRING,
                state={"type": "string", "enum": ["READY", "LOADING", "UNLOADING", "UNAVAILABLE"]},
                reason=STRING,
            )
        ),
        "repository_command": obj(
            parameters=obj(
                version={
                    "type": "integer",
                    "minimum": 0,
                    "description": "one version; absent or 0 = every version",
                }
            )
        ),
        "repository_load": obj(("name", "load"), name=STRING, load=BOOLEAN),
        "repository_unload": obj(("name", "unload"), name=STRING, unload=BOOLEAN),
        "mindspore_request": obj(("instances",), instances=array({"type": "object"})),
        "mindspore_response": {
            "type": "object",
            "properties": {"instances": array({"type": "object"}), "error_msg": STRING},
        },
        "mesh_status": {
            "type": "object",
            "description": "The scheduler's latest MeshStatus (see shardserve.wire.protocol), "
            "plus fresh and age_s.",
            "properties": {
                "fresh": BOOLEAN,
                "age_s": NUMBER,
                "scheduler": STRING,
                "servables": array({"type": "object"}),
            },
            "required": ["fresh"],
        },
        "timeseries": obj(
            ("interval_s", "points"),
            interval_s=INTEGER,
            points=array(
                obj(
                    ("t", "requests", "errors", "p50_ms", "p99_ms"),
                    t=INTEGER,
                    requests=INTEGER,
                    errors=INTEGER,
                    p50_ms={"type": ["number", "null"]},
                    p99_ms={"type": ["number", "null"]},
                )
            ),
        ),
    }


def _json_body(schema: Schema, description: str) -> Schema:
    return {"description": description, "content": {JSON: {"schema": schema}}}


ERRORS: dict[str, Schema] = {
    status: _json_body(ref("error"), description)
    for status, description in (
        ("400", "bad input"),
        ("401", "missing or invalid bearer token"),
        ("404", "unknown model, version or method"),
        ("413", "body too large"),
        ("503", "not ready, overloaded, broker unreachable or scheduler restarted"),
        ("504", "deadline exceeded"),
        ("500", "internal error (a rank failed, ranks disagreed)"),
    )
}


def _op(summary: str, ok: Schema, *errors: str, body: Schema | None = None) -> Schema:
    operation: Schema = {
        "summary": summary,
        "responses": {"200": ok, **{code: ERRORS[code] for code in errors}},
    }
    if body is not None:
        operation["requestBody"] = body
    return operation


def _path_param(name: str, description: str) -> Schema:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "schema": STRING,
        "description": description,
    }


MODEL = _path_param("model", "servable name, or <servable>:<method> for another method")
VERSION = _path_param("version", "a positive integer")

INFER_DESCRIPTION = (
    "JSON, or the binary tensor data extension: Content-Type application/octet-stream "
    "with an Inference-Header-Content-Length header giving the size of the JSON part; "
    "binary tensors follow it in input order. Headers: X-Request-Timeout (seconds), "
    "X-Request-Id. Content-Encoding gzip/deflate accepted."
)


def _model_paths() -> dict[str, Schema]:
    paths: dict[str, Schema] = {}
    for base, params in (
        ("/v2/models/{model}", [MODEL]),
        ("/v2/models/{model}/versions/{version}", [MODEL, VERSION]),
    ):
        paths[base] = {
            "parameters": params,
            "get": _op(
                "Model metadata", _json_body(ref("model_metadata"), "metadata"), "404", "503"
            ),
        }
        paths[base + "/ready"] = {
            "parameters": params,
            "get": _op("Model readiness", _json_body(ref("model_ready"), "ready"), "404", "503"),
        }
        paths[base + "/infer"] = {
            "parameters": params,
            "post": {
                **_op(
                    "Inference",
                    _json_body(ref("inference_response"), "outputs"),
                    *("400", "401", "404", "413", "500", "503", "504"),
                    body=_json_body(ref("inference_request"), INFER_DESCRIPTION),
                ),
                "description": INFER_DESCRIPTION,
            },
        }
    return paths


def _repository_paths() -> dict[str, Schema]:
    command = _json_body(ref("repository_command"), "optional; empty body allowed")
    return {
        "/v2/repository/index": {
            "post": _op(
                "Servable versions and their states",
                _json_body(ref("repository_index"), "index"),
                "400",
                "503",
                body=_json_body(ref("repository_index_request"), "optional filter"),
            )
        },
        "/v2/repository/models/{model}/load": {
            "parameters": [MODEL],
            "post": _op(
                "Load a servable (asynchronous; watch the index)",
                _json_body(ref("repository_load"), "command taken"),
                *("400", "503"),
                body=command,
            ),
        },
        "/v2/repository/models/{model}/unload": {
            "parameters": [MODEL],
            "post": _op(
                "Unload a servable (drains, then drops it)",
                _json_body(ref("repository_unload"), "command taken"),
                *("400", "404", "503"),
                body=command,
            ),
        },
    }


def _server_paths() -> dict[str, Schema]:
    metadata = {"get": _op("Server metadata", _json_body(ref("server_metadata"), "metadata"))}
    return {
        "/v2": metadata,
        "/v2/": metadata,
        "/v2/health/live": {"get": _op("Liveness", _json_body(ref("live"), "live"))},
        "/v2/health/ready": {
            "get": _op("Readiness of every servable", _json_body(ref("ready"), "ready"), "503")
        },
        "/v2/models": {
            "get": _op(
                "Model names (one per method)", _json_body(ref("model_list"), "names"), "503"
            )
        },
    }


def _mindspore_and_ops_paths() -> dict[str, Schema]:
    text = {"text/plain": {"schema": STRING}}
    return {
        "/model/{tail}": {
            "parameters": [
                _path_param("tail", "<servable>[/version/<n>]:<method> (MindSpore Serving REST)")
            ],
            "post": _op(
                "MindSpore Serving REST inference",
                _json_body(ref("mindspore_response"), "per-instance outputs or error_msg"),
                *("400", "404", "503", "504"),
                body=_json_body(ref("mindspore_request"), "instances"),
            ),
        },
        "/": {
            "get": _op(
                "Status page (HTML)",
                {"description": "page", "content": {"text/html": {"schema": STRING}}},
            )
        },
        "/api/status": {"get": _op("Latest mesh status", _json_body(ref("mesh_status"), "status"))},
        "/api/timeseries": {
            "get": {
                **_op("Per-second traffic", _json_body(ref("timeseries"), "points")),
                "parameters": [
                    {"name": "last", "in": "query", "required": False, "schema": INTEGER}
                ],
            }
        },
        "/metrics": {
            "get": _op("Prometheus metrics", {"description": "text exposition", "content": text})
        },
        "/openapi.json": {
            "get": _op("This document", {"description": "OpenAPI", "content": {JSON: {}}})
        },
    }


@cache
def document() -> dict[str, Any]:
    """The whole OpenAPI document."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "shardserve gateway",
            "version": shardserve.__version__,
            "description": "KServe v2 / Open Inference Protocol (REST), its model repository "
            "extension and generate extension, OpenAI-compatible text generation (/v1), "
            'MindSpore Serving REST, and operations. Errors are {"error", "code"} '
            '({"error_msg"} on /model/...). With bearer tokens configured every route needs '
            "'Authorization: Bearer <token>' except health, /metrics, / and /openapi.json "
            "(with --open-health).",
        },
        "paths": {
            **_server_paths(),
            **_model_paths(),
            **_repository_paths(),
            **_mindspore_and_ops_paths(),
            **generation_paths(MODEL, VERSION),
        },
        "components": {
            "schemas": {
                **_tensor_schemas(),
                **_kserve_schemas(),
                **_other_schemas(),
                **generation_schemas(),
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{}, {"bearer": []}],
    }
