"""gRPC over HTTP/2, the parts with no I/O: status codes, length-prefixed messages,
``grpc-timeout``, metadata and the status trailers (gRPC's PROTOCOL-HTTP2.md).

Compressed messages (``grpc-encoding: gzip`` or ``deflate``, as grpc clients send when
asked to compress) are inflated, bounded by the message limit so a small compressed
message cannot inflate to gigabytes; responses go out uncompressed (``identity``).
"""

from __future__ import annotations

import base64
import enum
import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from urllib.parse import quote

PREFIX = struct.Struct(">BI")  # compressed flag, message length
TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
ENCODINGS = {"identity": None, "gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
ACCEPT_ENCODING = ",".join(ENCODINGS)
# Headers that are HTTP/2's or gRPC's own, not the call's metadata.
RESERVED = frozenset(
    {"content-type", "te", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding", "user-agent"}
)
Metadata = Sequence[tuple[str, str | bytes]]


class StatusCode(enum.IntEnum):
    """gRPC's status codes (doc/statuscodes.md)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    RESOURCE_EXHAUSTED = 8
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16


class CallError(Exception):
    """A call ends with this status before its handler runs (or while it reads)."""

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def frame(message: bytes) -> bytes:
    """A message as it goes on the wire: uncompressed, length-prefixed."""
    return PREFIX.pack(0, len(message)) + message


class MessageReader:
    """Cuts a stream's DATA into messages, at most ``limit`` bytes each (inflated)."""

    def __init__(self, limit: int, encoding: str | None) -> None:
        self._limit = limit
        self._wbits = _wbits(encoding)
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The messages ``data`` completes (CallError for one too large or undecodable)."""
        self._buffer += data
        while len(self._buffer) >= PREFIX.size:
            compressed, length = PREFIX.unpack_from(self._buffer)
            if length > self._limit:
                raise _too_large(length, self._limit)
            if len(self._buffer) < PREFIX.size + length:
                return
            body = bytes(self._buffer[PREFIX.size : PREFIX.size + length])
            del self._buffer[: PREFIX.size + length]
            yield self._inflate(body) if compressed else body

    @property
    def partial(self) -> bool:
        """Bytes of an unfinished message are waiting (the stream ended mid-message)."""
        return bool(self._buffer)

    def _inflate(self, body: bytes) -> bytes:
        if self._wbits is None:
            raise CallError(
                StatusCode.INVALID_ARGUMENT,
                "a compressed message needs grpc-encoding gzip or deflate",
            )
        inflater = zlib.decompressobj(self._wbits)
        try:
            message = inflater.decompress(body, self._limit + 1)
        except zlib.error as exc:
            raise CallError(
                StatusCode.INVALID_ARGUMENT, f"cannot inflate the message: {exc}"
            ) from None
        if len(message) > self._limit:
            raise _too_large(len(message), self._limit)
        return message


def _wbits(encoding: str | None) -> int | None:
    if encoding is None:
        return None
    if encoding not in ENCODINGS:
        raise CallError(
            StatusCode.UNIMPLEMENTED,
            f"grpc-encoding {encoding!r} is not supported (supported: {ACCEPT_ENCODING})",
        )
    return ENCODINGS[encoding]


def _too_large(length: int, limit: int) -> CallError:
    return CallError(
        StatusCode.RESOURCE_EXHAUSTED,
        f"received message larger than max ({length} vs. {limit})",
    )


def parse_timeout(value: str) -> float:
    """Seconds from a ``grpc-timeout`` value (1-8 digits and a unit)."""
    digits, unit = value[:-1], value[-1:]
    if not (1 <= len(digits) <= 8 and digits.isascii() and digits.isdigit()):
        raise CallError(StatusCode.INVALID_ARGUMENT, f"malformed grpc-timeout {value!r}")
    if unit not in TIMEOUT_UNITS:
        raise CallError(StatusCode.INVALID_ARGUMENT, f"malformed grpc-timeout {value!r}")
    return int(digits) * TIMEOUT_UNITS[unit]


def metadata_of(headers: Iterable[tuple[str, str]]) -> tuple[tuple[str, str | bytes], ...]:
    """The call's metadata from its request headers (``-bin`` values base64-decoded)."""
    pairs: list[tuple[str, str | bytes]] = []
    for name, value in headers:
        if name.startswith(":") or name in RESERVED:
            continue
        if name.endswith("-bin"):
            try:
                padding = "=" * (-len(value) % 4)  # grpc sends it unpadded
                pairs.append((name, base64.b64decode(value + padding, validate=True)))
            except ValueError:
                raise CallError(StatusCode.INVALID_ARGUMENT, f"malformed {name} metadata") from None
        else:
            pairs.append((name, value))
    return tuple(pairs)


def metadata_headers(metadata: Metadata) -> list[tuple[str, str]]:
    """Headers for metadata sent back (``-bin`` values base64-encoded, unpadded)."""
    headers = []
    for name, value in metadata:
        if isinstance(value, bytes):
            value = base64.b64encode(value).decode("ascii").rstrip("=")
        headers.append((name.lower(), value))
    return headers


def status_trailers(code: StatusCode, message: str, metadata: Metadata) -> list[tuple[str, str]]:
    """The trailers that end a call with ``code``."""
    trailers = [("grpc-status", str(int(code)))]
    if message:
        # Percent-encoded as the spec asks: printable ASCII but '%' stays as is.
        trailers.append(("grpc-message", quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~")))
    return trailers + metadata_headers(metadata)
