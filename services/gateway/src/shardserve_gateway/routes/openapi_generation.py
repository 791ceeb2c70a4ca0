"""The OpenAPI part for text generation: OpenAI-compatible ``/v1/...`` and Triton's
generate extension (merged into ``openapi.document()``).

Request schemas list the fields we honour with their bounds; OpenAI bodies may carry
other fields (ignored, as OpenAI does), Triton generate bodies may not. Streams are
``text/event-stream``: one ``data: <json>`` per event in the streamed schema, OpenAI's
ending with ``data: [DONE]`` (absent after an error event).
"""

from __future__ import annotations

from shardserve_gateway.routes.openapi_schema import (
    BOOLEAN,
    INTEGER,
    JSON,
    STRING,
    Schema,
    array,
    obj,
    ref,
)

NULLABLE_STRING: Schema = {"type": ["string", "null"]}
EVENT_STREAM = "text/event-stream"
TIMEOUT_NOTE = (
    "Header X-Request-Timeout (seconds) bounds the whole generation; without it, the "
    "gateway's --first-token-timeout and --token-timeout bound its pace."
)
PENALTY = {"type": "number", "minimum": -2, "maximum": 2}
UNSUPPORTED = "400 naming the parameter unless absent"


def _sampling_fields() -> dict[str, Schema]:
    return {
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1, "description": "vLLM extension; -1/0 = off"},
        "n": {"type": "integer", "enum": [1]},
        "stop": {"anyOf": [STRING, array(STRING)]},
        "seed": {"type": "integer", "minimum": 0},
        "stream": BOOLEAN,
        "stream_options": obj(include_usage=BOOLEAN),
        "stop_token_ids": array({"type": "integer", "minimum": 0}),
        "ignore_eos": BOOLEAN,
        "presence_penalty": PENALTY,
        "frequency_penalty": PENALTY,
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
        "logit_bias": {
            "type": "object",
            "maxProperties": 300,
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            "description": "token id (as a string) -> bias; ids outside the vocabulary: 400",
        },
        "min_tokens": {"type": "integer", "minimum": 0, "description": "vLLM extension"},
        "tools": {"type": "array", "maxItems": 0, "description": UNSUPPORTED},
        "response_format": obj(("type",), type={"type": "string", "enum": ["text"]}),
    }


def _openai_requests() -> dict[str, Schema]:
    tokens = array({"type": "integer", "minimum": 0})
    prompt = {
        "anyOf": [STRING, tokens, array(STRING), array(tokens)],
        "description": "one prompt: a string or token ids (a list of one of them accepted)",
    }
    content = {"anyOf": [STRING, array(obj(("type", "text"), type=STRING, text=STRING))]}
    return {
        "completion_request": obj(
            ("model", "prompt"),
            model=STRING,
            prompt=prompt,
            max_tokens={"type": "integer", "minimum": 1, "default": 16},
            logprobs={"type": "integer", "minimum": 0, "maximum": 5},
            echo={"type": "boolean", "enum": [False]},
            best_of={"type": "integer", "enum": [1]},
            suffix={"type": "string", "maxLength": 0, "description": UNSUPPORTED},
            **_sampling_fields(),
        ),
        "chat_request": obj(
            ("model", "messages"),
            model=STRING,
            messages={
                "type": "array",
                "minItems": 1,
                "items": obj(("role", "content"), role=STRING, content=content),
            },
            max_tokens={"type": "integer", "minimum": 1, "description": "default: the context"},
            max_completion_tokens={"type": "integer", "minimum": 1},
            logprobs=BOOLEAN,
            top_logprobs={"type": "integer", "minimum": 0, "maximum": 5},
            **_sampling_fields(),
        ),
    }


def _openai_responses() -> dict[str, Schema]:
    usage = obj(
        ("prompt_tokens", "completion_tokens", "total_tokens"),
        prompt_tokens=INTEGER,
        completion_tokens=INTEGER,
        total_tokens=INTEGER,
    )
    envelope = {"id": STRING, "object": STRING, "created": INTEGER, "model": STRING}
    choice = {
        "index": INTEGER,
        "logprobs": {"type": ["object", "null"]},
        "finish_reason": NULLABLE_STRING,
    }
    message = obj(("role", "content"), role=STRING, content=STRING)
    return {
        "openai_usage": usage,
        "completion": obj(
            ("id", "object", "created", "model", "choices"),
            **envelope,
            choices=array(obj(("index", "text"), text=STRING, **choice)),
            usage={"anyOf": [ref("openai_usage"), {"type": "null"}]},
        ),
        "chat_completion": obj(
            ("id", "object", "created", "model", "choices"),
            **envelope,
            choices=array(obj(("index",), message=message, delta={"type": "object"}, **choice)),
            usage={"anyOf": [ref("openai_usage"), {"type": "null"}]},
        ),
        "openai_error": obj(
            ("error",),
            error=obj(
                ("message", "type"),
                message=STRING,
                type=STRING,
                param=NULLABLE_STRING,
                code=NULLABLE_STRING,
            ),
        ),
        "openai_model": obj(
            ("id", "object"), id=STRING, object=STRING, created=INTEGER, owned_by=STRING
        ),
        "openai_models": obj(("object", "data"), object=STRING, data=array(ref("openai_model"))),
    }


def _triton_schemas() -> dict[str, Schema]:
    properties: dict[str, Schema] = {
        "max_tokens": {"type": "integer", "minimum": 1, "description": "default: the context"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 100},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0},
        "seed": {"type": "integer", "minimum": 0},
        "stop": {"anyOf": [STRING, array(STRING)]},
        "stop_token_ids": array({"type": "integer", "minimum": 0}),
        "ignore_eos": BOOLEAN,
        "presence_penalty": PENALTY,
        "frequency_penalty": PENALTY,
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
        "min_tokens": {"type": "integer", "minimum": 0},
        "stream": BOOLEAN,
    }
    parameters = {"type": "object", "additionalProperties": False, "properties": properties}
    return {
        "generate_request": {
            # The parameters may also sit beside text_input (TensorRT-LLM's and vLLM's way).
            **obj(
                ("text_input",),
                text_input=STRING,
                parameters=parameters,
                **properties,
            ),
            "additionalProperties": False,
        },
        "generate_response": obj(
            ("model_name", "model_version", "text_output"),
            model_name=STRING,
            model_version=STRING,
            text_output=STRING,
        ),
    }


def generation_schemas() -> dict[str, Schema]:
    return {**_openai_requests(), **_openai_responses(), **_triton_schemas()}


def _body(schema: Schema, description: str, *, stream: bool = False) -> Schema:
    content: Schema = {JSON: {"schema": schema}}
    if stream:
        content[EVENT_STREAM] = {"schema": STRING, "description": "SSE: data: <json> events"}
    return {"description": description, "content": content}


def _errors(error_schema: str, *codes: str) -> dict[str, Schema]:
    why = {
        "400": "bad input",
        "401": "missing or invalid bearer token",
        "404": "unknown model, or not a text-generation model",
        "413": "body too large",
        "500": "internal error",
        "503": "not ready, overloaded (Retry-After) or scheduler lost",
        "504": "deadline exceeded",
    }
    return {code: _body(ref(error_schema), why[code]) for code in codes}


def _post(summary: str, request: str, ok: Schema, error_schema: str) -> Schema:
    codes = ("400", "401", "404", "413", "500", "503", "504")
    return {
        "post": {
            "summary": summary,
            "description": TIMEOUT_NOTE,
            "requestBody": _body(ref(request), "request", stream=False),
            "responses": {"200": ok, **_errors(error_schema, *codes)},
        }
    }


def generation_paths(model: Schema, version: Schema) -> dict[str, Schema]:
    paths: dict[str, Schema] = {
        "/v1/completions": _post(
            "OpenAI completion (stream: true -> SSE)",
            "completion_request",
            _body(ref("completion"), "completion, or SSE chunks", stream=True),
            "openai_error",
        ),
        "/v1/chat/completions": _post(
            "OpenAI chat completion (stream: true -> SSE)",
            "chat_request",
            _body(ref("chat_completion"), "chat completion, or SSE chunks", stream=True),
            "openai_error",
        ),
        "/v1/models": {
            "get": {
                "summary": "Text-generation models",
                "responses": {
                    "200": _body(ref("openai_models"), "models"),
                    **_errors("openai_error", "503"),
                },
            }
        },
        "/v1/models/{model}": {
            "parameters": [model],
            "get": {
                "summary": "One text-generation model (the openai package's models.retrieve)",
                "responses": {
                    "200": _body(ref("openai_model"), "the model"),
                    **_errors("openai_error", "404", "503"),
                },
            },
        },
    }
    for base, params in (
        ("/v2/models/{model}", [model]),
        ("/v2/models/{model}/versions/{version}", [model, version]),
    ):
        ok = _body(ref("generate_response"), "the generated text")
        streamed = {"description": "SSE", "content": {EVENT_STREAM: {"schema": STRING}}}
        generate = _post("Generate (Triton extension)", "generate_request", ok, "error")
        stream = _post("Generate, streamed as SSE", "generate_request", streamed, "error")
        paths[base + "/generate"] = {"parameters": params, **generate}
        paths[base + "/generate_stream"] = {"parameters": params, **stream}
    return paths
