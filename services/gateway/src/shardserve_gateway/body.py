"""Reading a request body within the size limit, after decompression.

aiohttp decompresses gzip/deflate bodies as they stream in and ``request.read()`` stops
with 413 as soon as the *decompressed* size passes ``client_max_size``, so a gzip bomb
costs at most the limit in memory. A declared ``Content-Length`` above the limit is
refused before reading anything.
"""

from __future__ import annotations

from aiohttp import web

from shardserve_gateway.errors import PayloadTooLargeError, UnsupportedEncodingError

ACCEPTED_ENCODINGS = frozenset({"", "identity", "gzip", "x-gzip", "deflate"})


def check_content_encoding(request: web.Request) -> None:
    """Refuse encodings aiohttp would pass through undecoded (or that we do not accept)."""
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ACCEPTED_ENCODINGS:
        raise UnsupportedEncodingError(encoding)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole (decompressed) body, or PayloadTooLargeError naming the limit."""
    check_content_encoding(request)
    declared = request.content_length
    if declared is not None and declared > limit:
        raise PayloadTooLargeError(limit)
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLargeError(limit) from None
