"""Middlewares, outermost first: request context (request id, in-flight count, metrics),
error translation (every failure becomes one JSON error response), then authentication
(``auth.py``), which runs before any handler reads a body."""

from __future__ import annotations

import logging
import time
import uuid

from aiohttp import web
from aiohttp.typedefs import Handler

from shardserve.errors import ErrorCode, InferenceError
from shardserve.process.lifecycle import request_id_var
from shardserve_gateway.codecs.openai_responses import error as openai_error
from shardserve_gateway.errors import INTERNAL_MESSAGE, ClientGoneError, HttpError
from shardserve_gateway.responses import error_response, json_response
from shardserve_gateway.state import INFER_LABELS_KEY, INFLIGHT_KEY, METRICS_KEY, TIMESERIES_KEY

_logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID = 128
MINDSPORE_PREFIX = "/model/"
OPENAI_PREFIX = "/v1"


def valid_request_id(value: str) -> bool:
    """1..128 printable ASCII characters (it ends up in logs and on the wire)."""
    return 0 < len(value) <= MAX_REQUEST_ID and value.isascii() and value.isprintable()


@web.middleware
async def request_context(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request id in, request id out; count in-flight requests; record inference metrics."""
    app = request.app
    started = time.monotonic()
    given = request.headers.get(REQUEST_ID_HEADER)
    request_id = given if given is not None and valid_request_id(given) else uuid.uuid4().hex
    token = request_id_var.set(request_id)
    app[INFLIGHT_KEY].enter()
    app[METRICS_KEY].inflight += 1
    try:
        if given is not None and given != request_id:
            response: web.StreamResponse = _error(
                request,
                400,
                f"{REQUEST_ID_HEADER} must be 1-{MAX_REQUEST_ID} printable ASCII chars",
                ErrorCode.BAD_INPUT,
            )
        else:
            response = await handler(request)
        response.headers[REQUEST_ID_HEADER] = request_id
        _record(request, response.status, time.monotonic() - started)
    finally:
        app[METRICS_KEY].inflight -= 1
        app[INFLIGHT_KEY].leave()
        request_id_var.reset(token)
    return response


def _record(request: web.Request, status: int, elapsed_s: float) -> None:
    """Metrics, time series and a debug access line (with the request id) per inference."""
    labels = request.get(INFER_LABELS_KEY)
    if labels is None:
        return
    request.app[METRICS_KEY].observe(labels, status, elapsed_s)
    request.app[TIMESERIES_KEY].observe(elapsed_s, failed=status >= 400)
    _logger.debug(
        "%s %s -> %d in %.1f ms", request.method, request.path, status, elapsed_s * 1000.0
    )


@web.middleware
async def translate_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as ``{"error": ..., "code": ...}`` (``{"error_msg": ...}`` on
    MindSpore routes, OpenAI's ``{"error": {"message", "type", "param", "code"}}`` on /v1)."""
    try:
        return await handler(request)
    except InferenceError as exc:
        _log_error(exc.status, exc.message)
        retry = {"Retry-After": "1"} if exc.code == ErrorCode.OVERLOADED else None
        return _error(request, exc.status, exc.message, exc.code, headers=retry)
    except ClientGoneError as exc:
        _logger.info("%s %s: %s", request.method, request.path, exc.message)
        return _error(request, exc.status, exc.message)  # nobody reads it; aiohttp drops it
    except HttpError as exc:
        _log_error(exc.status, exc.message)
        return _error(request, exc.status, exc.message, headers=exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = ErrorCode.NOT_FOUND if exc.status == 404 else None
        message = _http_message(request, exc)
        return _error(request, exc.status, message, code, headers=_allow_header(exc))
    except Exception:
        _logger.exception("internal error on %s %s", request.method, request.path)
        return _error(request, 500, INTERNAL_MESSAGE, ErrorCode.INTERNAL)


def _error(
    request: web.Request,
    status: int,
    message: str,
    code: ErrorCode | None = None,
    *,
    headers: dict[str, str] | None = None,
) -> web.Response:
    if request.path == OPENAI_PREFIX or request.path.startswith(OPENAI_PREFIX + "/"):
        # The openai package reads OpenAI's shape on every /v1 route, unknown ones too.
        return json_response(openai_error(message, status, code), status, headers)
    mindspore = request.path.startswith(MINDSPORE_PREFIX)
    return error_response(status, message, code=code, mindspore=mindspore, headers=headers)


def _log_error(status: int, message: str) -> None:
    level = logging.WARNING if status >= 500 else logging.INFO
    _logger.log(level, "answering %d: %s", status, message)


def _http_message(request: web.Request, exc: web.HTTPException) -> str:
    if exc.status == 404:
        return f"no route for {request.method} {request.path}"
    if exc.status == 405:
        return f"method {request.method} is not allowed on {request.path}"
    return exc.reason


def _allow_header(exc: web.HTTPException) -> dict[str, str]:
    allow = exc.headers.get("Allow")
    return {"Allow": allow} if allow else {}
