"""The building blocks of the OpenAPI document's JSON schemas, shared by its parts
(``openapi`` and ``openapi_generation``, which each import them from here)."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

JSON = "application/json"


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def obj(required: tuple[str, ...] = (), **properties: Schema) -> Schema:
    schema: Schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    return schema


def array(items: Schema) -> Schema:
    return {"type": "array", "items": items}


STRING: Schema = {"type": "string"}
BOOLEAN: Schema = {"type": "boolean"}
INTEGER: Schema = {"type": "integer"}
NUMBER: Schema = {"type": "number"}
PARAMETERS: Schema = {"type": "object"}
