"""Errors the client raises: the shardserve InferenceError tree, chosen by HTTP status.

A gateway answers errors as ``{"error": "<message>"}`` (KServe); when the body also
carries ``"code"`` (an ErrorCode value) that code picks the class exactly. Otherwise the
HTTP status does: 400 BadInputError, 404 NotFoundError, 429 OverloadedError,
503 UnavailableError, 504 DeadlineError, 500 and other 5xx InternalError. Statuses no
ErrorCode describes (401, 403, 413, ...) raise ``ClientError`` with that status.
Failing to reach the gateway at all raises ``TransportError`` (an UnavailableError).
"""

from __future__ import annotations

import json

from shardserve.errors import ErrorCode, InferenceError, error_for

_CODE_BY_STATUS: dict[int, ErrorCode] = {
    400: ErrorCode.BAD_INPUT,
    404: ErrorCode.NOT_FOUND,
    429: ErrorCode.OVERLOADED,
    500: ErrorCode.INTERNAL,
    502: ErrorCode.UNAVAILABLE,
    503: ErrorCode.UNAVAILABLE,
    504: ErrorCode.DEADLINE,
}


class ClientError(InferenceError):
    """An HTTP error status that no ErrorCode describes (401, 403, 413, ...)."""

    def __init__(self, message: str, http_status: int) -> None:
        super().__init__(message, ErrorCode.BAD_INPUT)
        self.http_status = http_status

    @property
    def status(self) -> int:
        return self.http_status


class TransportError(InferenceError):
    """The gateway could not be reached, or the connection broke mid-request."""

    code = ErrorCode.UNAVAILABLE


def error_from_http(status: int, body: bytes) -> InferenceError:
    """Build the exception for an HTTP error response."""
    message, code = _parse_error_body(body)
    message = message or f"HTTP {status}"
    if code is None:
        code = _CODE_BY_STATUS.get(status)
    if code is None and status >= 500:
        code = ErrorCode.INTERNAL
    if code is None:
        return ClientError(message, status)
    return error_for(code, message)


def _parse_error_body(body: bytes) -> tuple[str, ErrorCode | None]:
    try:
        parsed = json.loads(body) if body else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        return body.decode("utf-8", "replace").strip()[:2000], None
    message = parsed.get("error") or parsed.get("error_msg") or ""
    code = parsed.get("code")
    known = code if code in ErrorCode._value2member_map_ else None
    return str(message), ErrorCode(known) if known is not None else None
