"""What every gRPC call goes through, as every REST request goes through the middlewares:
the request id (``x-request-id`` metadata in and out), the in-flight count the drain
waits for, the bearer token (``authorization`` metadata), the metrics, and one gRPC
status for every failure.

Status codes: 400 -> INVALID_ARGUMENT, 404 -> NOT_FOUND, 503 (not ready, overloaded,
draining, broker down) -> UNAVAILABLE with ``retry-after`` seconds in the trailing
metadata when a retry may help, 504 -> DEADLINE_EXCEEDED, 401 -> UNAUTHENTICATED,
everything else -> INTERNAL. Messages larger than ``--max-body-mb`` are refused by the
transport with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from aiohttp import web

from shardserve.errors import BadInputError, ErrorCode, InferenceError
from shardserve.process.lifecycle import request_id_var
from shardserve_gateway.auth import token_matches
from shardserve_gateway.errors import INTERNAL_MESSAGE
from shardserve_gateway.grpcapi.transport.context import AbortError, CallContext
from shardserve_gateway.grpcapi.transport.wire import CallError, StatusCode
from shardserve_gateway.metrics import Labels
from shardserve_gateway.middleware import MAX_REQUEST_ID, valid_request_id
from shardserve_gateway.state import INFLIGHT_KEY, METRICS_KEY, SETTINGS_KEY, TIMESERIES_KEY

_logger = logging.getLogger(__name__)

REQUEST_ID_KEY = "x-request-id"
RETRY_AFTER_KEY = "retry-after"
# What tells a client of an UNAVAILABLE call that retrying may help (in a second).
RETRY_LATER = ((RETRY_AFTER_KEY, "1"),)
CLIENT_CLOSED = 499

STATUS_CODES: dict[ErrorCode, StatusCode] = {
    ErrorCode.BAD_INPUT: StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: StatusCode.NOT_FOUND,
    ErrorCode.UNAVAILABLE: StatusCode.UNAVAILABLE,
    ErrorCode.OVERLOADED: StatusCode.UNAVAILABLE,
    ErrorCode.RANK_LOST: StatusCode.UNAVAILABLE,
    ErrorCode.DEADLINE: StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.CANCELLED: StatusCode.CANCELLED,
}
_RETRYABLE = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.OVERLOADED, ErrorCode.RANK_LOST})


def status_code(error: InferenceError) -> StatusCode:
    """The gRPC status that answers an inference error."""
    return STATUS_CODES.get(error.code, StatusCode.INTERNAL)


class Unauthenticated(Exception):
    """No bearer token in the metadata, or one that matches none of the tokens."""


@dataclass
class Call:
    """One call's bookkeeping: its request id and, once known, its metrics labels."""

    request_id: str
    labels: Labels | None = None


class CallGuard:
    """Opens the scope every handler runs in (``scope``)."""

    def __init__(self, app: web.Application) -> None:
        self._app = app
        settings = app[SETTINGS_KEY]
        self._tokens = tuple(t.encode("utf-8") for t in settings.tokens)
        self._open_health = settings.open_health

    @contextlib.asynccontextmanager
    async def scope(self, context: CallContext, *, health: bool = False) -> AsyncIterator[Call]:
        """Run a handler: request id, in-flight count, token check, metrics, and every
        failure aborted with its gRPC status (``health`` calls need no token when the
        gateway serves health openly)."""
        started = time.monotonic()
        metadata = _metadata(context)
        given = metadata.get(REQUEST_ID_KEY)
        call = Call(given if given is not None and valid_request_id(given) else uuid.uuid4().hex)
        reset = request_id_var.set(call.request_id)
        self._enter()
        status = 200
        try:
            if given is not None and given != call.request_id:
                raise BadInputError(f"{REQUEST_ID_KEY} must be 1-{MAX_REQUEST_ID} printable ASCII")
            self._authenticate(metadata, health=health)
            yield call
        except asyncio.CancelledError:
            remaining = context.time_remaining()
            status = 504 if remaining is not None and remaining <= 0 else CLIENT_CLOSED
            raise
        except (AbortError, CallError):
            raise  # already aborted (its status set), or the call itself is malformed
        except Exception as exc:
            code, message, status, trailing = _failure(exc, call)
            await context.abort(code, message, trailing_metadata=trailing)
        finally:
            self._leave(call, status, time.monotonic() - started)
            request_id_var.reset(reset)
        context.set_trailing_metadata(((REQUEST_ID_KEY, call.request_id),))

    def _authenticate(self, metadata: dict[str, str], *, health: bool) -> None:
        if not self._tokens or (health and self._open_health):
            return
        scheme, _, credentials = metadata.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            raise Unauthenticated("missing bearer token (metadata 'authorization: Bearer <token>')")
        if not token_matches(credentials.strip().encode("utf-8"), self._tokens):
            raise Unauthenticated("invalid bearer token")

    def _enter(self) -> None:
        self._app[INFLIGHT_KEY].enter()
        self._app[METRICS_KEY].inflight += 1

    def _leave(self, call: Call, status: int, elapsed_s: float) -> None:
        self._app[METRICS_KEY].inflight -= 1
        self._app[INFLIGHT_KEY].leave()
        if call.labels is not None:
            self._app[METRICS_KEY].observe(call.labels, status, elapsed_s)
            self._app[TIMESERIES_KEY].observe(elapsed_s, failed=status >= 400)


def _metadata(context: CallContext) -> dict[str, str]:
    pairs: Sequence[tuple[str, str | bytes]] = context.invocation_metadata() or ()
    return {key: value for key, value in pairs if isinstance(value, str)}


def _failure(
    exc: Exception, call: Call
) -> tuple[StatusCode, str, int, tuple[tuple[str, str], ...]]:
    """The gRPC status, message, HTTP-equivalent status (for the metrics) and trailing
    metadata that answer ``exc``."""
    trailing = [(REQUEST_ID_KEY, call.request_id)]
    if isinstance(exc, InferenceError):
        if exc.code in _RETRYABLE:
            trailing.extend(RETRY_LATER)
        level = logging.WARNING if exc.status >= 500 else logging.INFO
        _logger.log(level, "gRPC call answered %s: %s", status_code(exc).name, exc.message)
        return status_code(exc), exc.message, exc.status, tuple(trailing)
    if isinstance(exc, Unauthenticated):
        return StatusCode.UNAUTHENTICATED, str(exc), 401, tuple(trailing)
    _logger.error("internal error in a gRPC call", exc_info=exc)
    return StatusCode.INTERNAL, INTERNAL_MESSAGE, 500, tuple(trailing)
