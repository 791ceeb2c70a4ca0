"""Reading a request body within the size limit, after decompression.

The server runs with aiohttp's ``auto_decompress`` off: aiohttp inflates on the event
loop as bytes arrive (and keeps inflating the unread rest of a refused body), so a 256 KiB
gzip bomb froze the gateway for seconds (found by ``shardserve chaos``, bad-http). Here
the compressed body is read (bounded by ``client_max_size``) and inflated in a thread, at
most ``limit + 1`` bytes. A declared ``Content-Length`` above the limit is refused before
reading anything.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable

from aiohttp import web

from shardserve.errors import BadInputError
from shardserve_gateway.errors import (
    BodyTimeoutError,
    ClientGoneError,
    PayloadTooLargeError,
    UnsupportedEncodingError,
)

# A body that has not fully arrived by then belongs to a stalled or hostile client; the
# connection and its buffers are released with a 408 instead of being held forever.
BODY_TIMEOUT_S = 30.0
ACCEPTED_ENCODINGS = frozenset({"", "identity", "gzip", "x-gzip", "deflate"})


def check_content_encoding(request: web.Request) -> None:
    """Refuse encodings aiohttp would pass through undecoded (or that we do not accept)."""
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ACCEPTED_ENCODINGS:
        raise UnsupportedEncodingError(encoding)


async def read_body(
    request: web.Request,
    limit: int,
    body_timeout_s: float = BODY_TIMEOUT_S,
    *,
    too_large: Callable[[int], PayloadTooLargeError] = PayloadTooLargeError,
) -> bytes:
    """The whole (decompressed) body, or ``too_large(limit)`` (a 413 naming the limit)
    as soon as it is known to be larger."""
    check_content_encoding(request)
    declared = request.content_length
    if declared is not None and declared > limit:
        raise too_large(limit)
    try:
        async with asyncio.timeout(body_timeout_s):
            raw = await _read_within(request, limit, declared)
    except (web.HTTPRequestEntityTooLarge, PayloadTooLargeError):
        raise too_large(limit) from None
    except TimeoutError:
        raise BodyTimeoutError(body_timeout_s) from None
    except (ConnectionResetError, ConnectionError):
        raise ClientGoneError() from None
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if not _still_compressed(raw, encoding):  # identity, or inflated by aiohttp already
        return raw
    try:
        return await asyncio.to_thread(inflate, raw, encoding, limit)
    except PayloadTooLargeError:
        raise too_large(limit) from None


async def _read_within(request: web.Request, limit: int, declared: int | None) -> bytes:
    """The raw body; one that declares no length (chunked) is refused once more than
    ``limit`` bytes have arrived, not read whole first (aiohttp bounds it only by
    ``client_max_size``, the gateway's largest limit)."""
    if declared is not None:
        return await request.read()
    body = bytearray()
    async for piece in request.content.iter_any():
        body += piece
        if len(body) > limit:
            raise PayloadTooLargeError(limit)
    return bytes(body)


def _still_compressed(raw: bytes, encoding: str) -> bool:
    if encoding in ("gzip", "x-gzip"):
        return raw[:2] == b"\x1f\x8b"
    return (
        encoding == "deflate"
        and len(raw) >= 2
        and (raw[0] & 0x0F) == 8
        and ((raw[0] << 8) | raw[1]) % 31 == 0
    )


def inflate(raw: bytes, encoding: str, limit: int) -> bytes:
    """Decompress at most ``limit`` bytes; more is PayloadTooLargeError."""
    wbits = 16 + zlib.MAX_WBITS if encoding in ("gzip", "x-gzip") else zlib.MAX_WBITS
    try:
        out = zlib.decompressobj(wbits).decompress(raw, limit + 1)
    except zlib.error as exc:
        raise BadInputError(f"request body is not valid {encoding}: {exc}") from None
    if len(out) > limit:
        raise PayloadTooLargeError(limit)
    return out
