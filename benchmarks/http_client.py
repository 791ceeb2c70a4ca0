"""A lean HTTP/1.1 client for the load generator: keep-alive connections, one fixed POST.

The load generator shares this machine's cores with what it measures. aiohttp's client
costs about 0.2-0.25 ms of CPU per request here, as much as a whole service hop of the
mesh; a multi-process system under test loses that CPU, a one-process floor server barely
notices. This client writes a request prepared once and reads the answer with asyncio
streams (status line, headers, a Content-Length or chunked body), so the measurement
takes as little as it can from the measured. It speaks only what the load needs: POST,
HTTP/1.1, no redirects, no compression, no TLS.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024
BUFFER_BYTES = 4 * 1024 * 1024  # the stream buffer; a head must fit in MAX_HEAD_BYTES


class HttpError(RuntimeError):
    """The server answered with a status other than 200, or broke the protocol."""


def prepared_post(url: str, body: bytes, headers: dict[str, str]) -> tuple[str, int, bytes]:
    """(host, port, the request's bytes) for POSTing ``body`` to ``url``."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise ValueError(f"only plain http:// URLs are supported, got {url!r}")
    port = parts.port or 80
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    lines = [f"POST {path} HTTP/1.1", f"Host: {parts.hostname}:{port}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append(f"Content-Length: {len(body)}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return parts.hostname, port, head + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """(status, body, whether the connection may be used again) of one response."""
    head = await reader.readuntil(b"\r\n\r\n")
    if len(head) > MAX_HEAD_BYTES:
        raise HttpError("response head too large")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(status_line.split(" ", 2)[1])
    except (IndexError, ValueError):
        raise HttpError(f"malformed status line {status_line!r}") from None
    fields = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if sep:
            fields[name.strip().lower()] = value.strip()
    keep = fields.get("connection", "").lower() != "close"
    if "chunked" in fields.get("transfer-encoding", "").lower():
        return status, await _read_chunked(reader), keep
    if "content-length" in fields:
        return status, await reader.readexactly(int(fields["content-length"])), keep
    return status, await reader.read(), False  # delimited by the end of the connection


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    chunks: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")  # the (empty) trailer section
            return b"".join(chunks)
        chunks.append(await reader.readexactly(size))
        await reader.readexactly(2)


class PostClient:
    """POSTs one prepared request over a pool of keep-alive connections (one per caller
    at a time); a connection that failed or was closed by the server is dropped."""

    def __init__(self, url: str, body: bytes, headers: dict[str, str]) -> None:
        self._host, self._port, self._request = prepared_post(url, body, headers)
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._all: set[asyncio.StreamWriter] = set()

    @property
    def open_connections(self) -> int:
        """Connections this client holds now (idle or in use)."""
        return len(self._all)

    async def post(self) -> bytes:
        """Send the request, return the 200 answer's body; HttpError for any other."""
        reader, writer = self._idle.pop() if self._idle else await self._connect()
        try:
            writer.write(self._request)
            status, payload, keep = await read_response(reader)
        except BaseException:
            self._drop(writer)
            raise
        if keep:
            self._idle.append((reader, writer))
        else:
            self._drop(writer)
        if status != 200:
            raise HttpError(f"HTTP {status}: {payload[:200]!r}")
        return payload

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(self._host, self._port, limit=BUFFER_BYTES)
        self._all.add(writer)
        return reader, writer

    def _drop(self, writer: asyncio.StreamWriter) -> None:
        self._all.discard(writer)
        writer.close()

    async def close(self) -> None:
        """Close every connection and wait for them to go."""
        writers, self._all, self._idle = list(self._all), set(), []
        for writer in writers:
            writer.close()
        for writer in writers:
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass

    def call(self) -> Callable[[], Awaitable[bool]]:
        """The load generator's call: one POST; success = HTTP 200 (else it raises)."""

        async def call() -> bool:
            await self.post()
            return True

        return call
