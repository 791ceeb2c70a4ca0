"""Building HTTP responses: JSON bodies with ``Content-Type: application/json`` exactly.

aiohttp's ``web.json_response`` appends ``; charset=utf-8``; the KServe SDK only reads an
error message when the content type is exactly ``application/json``, so every JSON body
is built as bytes with ``web.Response(body=...)``, which adds no charset.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from shardserve.errors import ErrorCode

JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"


def dump_json(payload: Any) -> bytes:
    """Serialize compactly to UTF-8 bytes."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def json_response(
    payload: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    """A JSON response without a charset suffix."""
    return web.Response(
        body=dump_json(payload), status=status, content_type=JSON_TYPE, headers=headers
    )


def error_body(
    message: str, *, code: ErrorCode | None = None, mindspore: bool = False
) -> dict[str, str]:
    """``{"error": ..., "code": ...}`` (KServe and our own routes) or ``{"error_msg": ...}``
    (MindSpore, whose clients know no code).

    ``code`` is the ErrorCode value, so a client can tell apart errors that share an HTTP
    status (``rank_lost`` and ``overloaded`` are both 503); it is left out for errors no
    ErrorCode describes (401, 405, 413, 415), where the status says it all.
    """
    if mindspore:
        return {"error_msg": message}
    body = {"error": message}
    if code is not None:
        body["code"] = code.value
    return body


def error_response(
    status: int,
    message: str,
    *,
    code: ErrorCode | None = None,
    mindspore: bool = False,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """An error response in the shape of the API the request came through."""
    return json_response(error_body(message, code=code, mindspore=mindspore), status, headers)
