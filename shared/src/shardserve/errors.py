"""The one exception tree of shardserve.

* ShardserveError            base of everything we raise on purpose
  + CodecError               bytes that are not a valid message (bad msgpack, schema, limits)
  + RepositoryError          a model repository, group config or slice that is wrong
    - ChecksumError          a slice file whose sha256 differs from the group config
    - UnsafePathError        a path that escapes the repository or slice folder
  + ExportError              an export/slice request that cannot be honoured (says why)
  + ServableConfigError      a broken servable_config.py (names file, line and problem)
  + InferenceError           a request that ended in an error; carries an ErrorCode
    - BadInputError          the client sent something wrong        (HTTP 400)
    - NotFoundError          unknown servable, version or method    (HTTP 404)
    - UnavailableError       group not ready, broker down, draining (HTTP 503)
    - OverloadedError        too many requests in flight            (HTTP 429/503)
    - DeadlineError          the deadline passed                    (HTTP 504)
    - InternalError          a rank failed or ranks disagreed       (HTTP 500)

`ErrorCode` is the wire form of an InferenceError: every error reply carries one, and
`http_status()` maps it to the status the gateway answers with.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """Why a request failed; travels on the wire."""

    BAD_INPUT = "bad_input"
    NOT_FOUND = "not_found"
    UNAVAILABLE = "unavailable"
    OVERLOADED = "overloaded"
    DEADLINE = "deadline_exceeded"
    INTERNAL = "internal"
    RANK_MISMATCH = "rank_mismatch"
    RANK_LOST = "rank_lost"
    STAGE_FAILED = "stage_failed"
    CANCELLED = "cancelled"  # the caller stopped a generation


_HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.BAD_INPUT: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.OVERLOADED: 503,
    ErrorCode.DEADLINE: 504,
    ErrorCode.INTERNAL: 500,
    ErrorCode.RANK_MISMATCH: 500,
    ErrorCode.RANK_LOST: 503,
    ErrorCode.STAGE_FAILED: 500,
    ErrorCode.CANCELLED: 499,  # "client closed request", as nginx names it
}


def http_status(code: ErrorCode) -> int:
    """Return the HTTP status that answers an error of this code."""
    return _HTTP_STATUS[code]


class ShardserveError(Exception):
    """Base of every exception shardserve raises on purpose."""


class CodecError(ShardserveError):
    """Bytes that do not decode to a valid message."""


class RepositoryError(ShardserveError):
    """A model repository, group config or slice that is wrong."""


class ChecksumError(RepositoryError):
    """A slice file whose sha256 differs from the group config."""


class UnsafePathError(RepositoryError):
    """A path that escapes the folder it must stay in."""


class ExportError(ShardserveError):
    """An export or slicing request that cannot be honoured."""


class ServableConfigError(ShardserveError):
    """A broken servable_config.py; the message names file, line and problem."""


class InferenceError(ShardserveError):
    """A request that ended in an error."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    @property
    def status(self) -> int:
        """HTTP status for this error."""
        return http_status(self.code)


class BadInputError(InferenceError):
    """The client sent something wrong."""

    code = ErrorCode.BAD_INPUT


class NotFoundError(InferenceError):
    """Unknown servable, version or method."""

    code = ErrorCode.NOT_FOUND


class UnavailableError(InferenceError):
    """The group is not ready, the broker is down or the service is draining."""

    code = ErrorCode.UNAVAILABLE


class OverloadedError(InferenceError):
    """Too many requests in flight."""

    code = ErrorCode.OVERLOADED


class DeadlineError(InferenceError):
    """The request's deadline passed."""

    code = ErrorCode.DEADLINE


class InternalError(InferenceError):
    """A rank failed or the ranks disagreed."""

    code = ErrorCode.INTERNAL


_BY_CODE: dict[ErrorCode, type[InferenceError]] = {
    ErrorCode.BAD_INPUT: BadInputError,
    ErrorCode.NOT_FOUND: NotFoundError,
    ErrorCode.UNAVAILABLE: UnavailableError,
    ErrorCode.OVERLOADED: OverloadedError,
    ErrorCode.DEADLINE: DeadlineError,
    ErrorCode.RANK_LOST: UnavailableError,
}


def error_for(code: ErrorCode, message: str) -> InferenceError:
    """Build the exception class that matches a wire error code."""
    cls = _BY_CODE.get(code, InternalError)
    return cls(message, code)
