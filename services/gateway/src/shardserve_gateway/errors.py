"""HTTP-level errors of the gateway itself (not inference outcomes).

Inference outcomes use ``shardserve.errors.InferenceError`` (its ``status`` gives the
HTTP status). ``HttpError`` covers what happens before a request is even understood:
401 no/bad token, 408 body not received in time, 413 body too large, 415 unknown content
encoding, and a client that went away mid-body (logged, never answered).
"""

from __future__ import annotations

# What a client is told of a failure the gateway did not foresee (the details are logged).
INTERNAL_MESSAGE = "internal error (see the gateway log)"


class HttpError(Exception):
    """An HTTP error answered as ``{"error": message}`` with extra headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


class UnauthorizedError(HttpError):
    """No bearer token, or one that matches none of the configured tokens."""

    def __init__(self, message: str) -> None:
        super().__init__(401, message, {"WWW-Authenticate": 'Bearer realm="shardserve"'})


class PayloadTooLargeError(HttpError):
    """The body (after decompression) is larger than its limit (--max-body-mb, or a
    generation route's own)."""

    def __init__(
        self,
        limit_bytes: int,
        why: str = "--max-body-mb; the limit applies after decompression",
    ) -> None:
        super().__init__(
            413, f"request body is larger than the limit of {_mib(limit_bytes)} ({why})"
        )


class UnsupportedEncodingError(HttpError):
    """A Content-Encoding other than gzip, deflate or identity."""

    def __init__(self, encoding: str) -> None:
        super().__init__(
            415,
            f"unsupported Content-Encoding {encoding!r}; use gzip, deflate or identity",
            {"Accept-Encoding": "gzip, deflate"},
        )


class BodyTimeoutError(HttpError):
    """The client did not send its whole body in time (a stalled or slowloris upload)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(408, f"request body not received within {seconds:g} s")


class ClientGoneError(HttpError):
    """The client closed the connection before its body arrived: nobody to answer."""

    def __init__(self) -> None:
        super().__init__(499, "client closed the connection while sending its request")


def _mib(n: int) -> str:
    mib = n / (1024 * 1024)
    return f"{mib:g} MiB" if mib >= 1 else f"{n} bytes"
