"""A lean gRPC client for the load generator: unary calls of one prepared request over
HTTP/2 frames written by hand, so the load takes as little CPU from the measured
processes as the HTTP load's client does (``http_client``).

grpc.aio's client costs about 0.4 ms of CPU per call here (docs/performance.md, issue
38), six times the lean HTTP client. This one writes each call as two frames prepared
once (HEADERS as stateless HPACK literals, then DATA), and reads the answer with a
frame reader: response headers decoded with the gateway's own HPACK decoder (it follows
the server's dynamic table, as any decoder must; ``hpack``'s cost 30 us a block here), the
call's status from ``grpc-status``. It speaks only what the load
needs: one call at a time per connection, no TLS, no compression, no metadata.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import struct
from collections.abc import Awaitable, Callable

from shardserve_gateway.grpcapi.transport.header_codec import HeaderDecoder
from shardserve_gateway.grpcapi.transport.http2 import (
    ACK,
    DEFAULT_FRAME_BYTES,
    END_HEADERS,
    END_STREAM,
    MAX_WINDOW,
    PREFACE,
    FrameType,
    Setting,
    frame_head,
)

DATA, HEADERS, RST_STREAM = FrameType.DATA, FrameType.HEADERS, FrameType.RST_STREAM
SETTINGS, PING, GOAWAY = FrameType.SETTINGS, FrameType.PING, FrameType.GOAWAY
WINDOW_UPDATE = FrameType.WINDOW_UPDATE
INITIAL_WINDOW, ENABLE_PUSH = Setting.INITIAL_WINDOW_SIZE, Setting.ENABLE_PUSH
READ_BYTES = 1024 * 1024


class GrpcCallError(RuntimeError):
    """The call ended with a status other than OK, or the server broke the protocol."""


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame."""
    return frame_head(kind, flags, stream_id, len(payload)) + payload


def literal_headers(headers: list[tuple[str, str]]) -> bytes:
    """An HPACK block of literals without indexing: the same bytes fit every request."""
    block = bytearray()
    for name, value in headers:
        block.append(0)
        for text in (name.encode("ascii"), value.encode("ascii")):
            if len(text) >= 127:
                raise ValueError("header too long for the one-byte length form")
            block.append(len(text))
            block += text
    return bytes(block)


class GrpcH2Connection:
    """One HTTP/2 connection carrying one unary call at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._decoder = HeaderDecoder()
        self._next_stream = 1
        self._received = 0
        self._buffer = bytearray()
        self._pending: collections.deque[tuple[int, int, int, bytes]] = collections.deque()

    @classmethod
    async def open(cls, host: str, port: int) -> GrpcH2Connection:
        reader, writer = await asyncio.open_connection(host, port, limit=4 * 1024 * 1024)
        settings = struct.pack(">HIHI", ENABLE_PUSH, 0, INITIAL_WINDOW, MAX_WINDOW)
        writer.write(
            PREFACE
            + frame(SETTINGS, 0, 0, settings)
            + frame(WINDOW_UPDATE, 0, 0, (MAX_WINDOW - 65535).to_bytes(4, "big"))
        )
        return cls(reader, writer)

    async def unary(self, headers_block: bytes, message: bytes) -> None:
        """One call; GrpcCallError unless it ends with grpc-status 0."""
        stream_id = self._next_stream
        self._next_stream += 2
        out = [frame(HEADERS, END_HEADERS, stream_id, headers_block)]
        body = struct.pack(">BI", 0, len(message)) + message
        for start in range(0, len(body), DEFAULT_FRAME_BYTES):
            chunk = body[start : start + DEFAULT_FRAME_BYTES]
            last = start + DEFAULT_FRAME_BYTES >= len(body)
            out.append(frame(DATA, END_STREAM if last else 0, stream_id, chunk))
        self._writer.write(b"".join(out))
        await self._until_status(stream_id)

    async def _until_status(self, stream_id: int) -> None:
        while True:
            if not self._pending:
                self._pending.extend(await self._frames())
            while self._pending:
                kind, flags, sid, payload = self._pending.popleft()
                if kind == HEADERS:
                    fields = dict(self._decoder.decode(payload)[0])
                    if sid == stream_id and flags & END_STREAM:
                        self._check(fields)
                        return  # frames after it wait in _pending for the next call
                elif kind == DATA:
                    self._returned(len(payload))
                else:
                    self._control(kind, flags, sid, payload, stream_id)

    async def _frames(self) -> list[tuple[int, int, int, bytes]]:
        """The whole frames that one read completes (one read per wake, as the server's
        side reads many frames per read)."""
        data = await self._reader.read(READ_BYTES)
        if not data:
            raise GrpcCallError("the server closed the connection")
        self._buffer += data
        frames, at = [], 0
        while len(self._buffer) - at >= 9:
            length = int.from_bytes(self._buffer[at : at + 3], "big")
            if len(self._buffer) - at < 9 + length:
                break
            kind, flags = self._buffer[at + 3], self._buffer[at + 4]
            sid = int.from_bytes(self._buffer[at + 5 : at + 9], "big") & MAX_WINDOW
            frames.append((kind, flags, sid, bytes(self._buffer[at + 9 : at + 9 + length])))
            at += 9 + length
        del self._buffer[:at]
        return frames

    @staticmethod
    def _check(trailers: dict[bytes, bytes]) -> None:
        status = trailers.get(b"grpc-status")
        if status != b"0":
            message = trailers.get(b"grpc-message", b"")
            raise GrpcCallError(f"grpc-status {status!r}: {message!r}")

    def _returned(self, length: int) -> None:
        """Hand the connection's window back in large steps (streams are fresh per call)."""
        self._received += length
        if self._received > MAX_WINDOW // 2:
            self._writer.write(frame(WINDOW_UPDATE, 0, 0, self._received.to_bytes(4, "big")))
            self._received = 0

    def _control(self, kind: int, flags: int, sid: int, payload: bytes, stream_id: int) -> None:
        if kind == SETTINGS and not flags & ACK:
            self._writer.write(frame(SETTINGS, ACK, 0))
        elif kind == PING and not flags & ACK:
            self._writer.write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM and sid == stream_id:
            raise GrpcCallError(f"the server reset the call ({payload.hex()})")
        elif kind == GOAWAY:
            raise GrpcCallError("the server closed the connection (GOAWAY)")

    async def close(self) -> None:
        """Close, and wait until the transport has: one left closing when its loop ends
        is reported unclosed later (a ResourceWarning in whatever runs then)."""
        self._writer.close()
        with contextlib.suppress(ConnectionError):
            await self._writer.wait_closed()


class GrpcH2Client:
    """Unary calls of one prepared request to ``path`` over a pool of connections (one
    per caller at a time); a connection whose call failed is dropped."""

    def __init__(self, address: str, path: str, message: bytes) -> None:
        host, _, port = address.rpartition(":")
        self._host, self._port = host, int(port)
        self._message = message
        self._headers = literal_headers(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", address),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ]
        )
        self._idle: list[GrpcH2Connection] = []
        self._all: list[GrpcH2Connection] = []

    async def unary(self) -> None:
        connection = self._idle.pop() if self._idle else await self._connect()
        try:
            await connection.unary(self._headers, self._message)
        except BaseException:
            self._all.remove(connection)
            await connection.close()
            raise
        self._idle.append(connection)

    async def _connect(self) -> GrpcH2Connection:
        connection = await GrpcH2Connection.open(self._host, self._port)
        self._all.append(connection)
        return connection

    async def close(self) -> None:
        connections, self._all, self._idle = self._all, [], []
        for connection in connections:
            await connection.close()

    def call(self) -> Callable[[], Awaitable[bool]]:
        """The load generator's call: one unary call; success = grpc-status 0."""

        async def call() -> bool:
            await self.unary()
            return True

        return call
