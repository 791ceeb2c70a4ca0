"""One call's HTTP/2 stream, as its handler uses it: the request messages in (with
HTTP/2 flow control handed back as they are read), responses out within the peer's
flow-control window, and the status that ends it."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Protocol

from shardserve_gateway.grpcapi.transport import http2
from shardserve_gateway.grpcapi.transport.wire import (
    ACCEPT_ENCODING,
    CallError,
    MessageReader,
    Metadata,
    StatusCode,
    frame,
    status_trailers,
)

RESPONSE_HEADERS = [
    (":status", "200"),
    ("content-type", "application/grpc"),
    ("grpc-accept-encoding", ACCEPT_ENCODING),
]
# Messages read but not yet taken by the handler, beyond which the peer's window is not
# handed back: a client streaming faster than the calls are served waits.
UNREAD_MESSAGES = 64
_END = object()


class Link(Protocol):
    """What a stream needs of its connection."""

    http2: http2.ServerConnection

    def flush_soon(self) -> None: ...

    async def writable(self) -> None: ...


class ServerStream:
    """The stream ``stream_id`` of ``link``; ``reader`` cuts its DATA into messages."""

    def __init__(self, link: Link, stream_id: int, reader: MessageReader) -> None:
        self._link = link
        self.stream_id = stream_id
        self._reader = reader
        self._inbox: collections.deque[bytes | CallError | object] = collections.deque()
        self._arrived = asyncio.Event()
        self._window = asyncio.Event()
        self._unacked = 0
        self._broken = False  # a bad message arrived: the rest is discarded
        self._headers_sent = False
        self.remote_ended = False
        self.ended = False  # status sent, reset, or connection lost
        self.reset_by_peer = False
        self.deadline_passed = False

    # -- in (called by the connection) ---------------------------------------------

    def received(self, data: bytes, flow_length: int) -> None:
        """DATA arrived: queue the messages it completes."""
        self._unacked += flow_length
        if self._broken:
            self._ack()  # discarded, but the connection's window must come back
            return
        try:
            self._inbox.extend(self._reader.feed(data))
        except CallError as exc:
            self._broken = True
            self._inbox.append(exc)
        self._arrived.set()
        if len(self._inbox) < UNREAD_MESSAGES:
            self._ack()

    def remote_end(self) -> None:
        """The client closed its side."""
        self.remote_ended = True
        if self._reader.partial and not self._broken:
            self._inbox.append(
                CallError(StatusCode.INVALID_ARGUMENT, "the stream ended mid-message")
            )
        self._inbox.append(_END)
        self._arrived.set()

    def window_opened(self) -> None:
        self._window.set()

    def closed(self, *, by_peer: bool) -> None:
        """Reset by the client, or the connection is gone: nothing more goes out."""
        self.ended = True
        self.reset_by_peer = by_peer
        self._window.set()

    # -- the handler's side ----------------------------------------------------------

    async def single_message(self) -> bytes:
        """The one request of a unary call."""
        messages = [message async for message in self.messages()]
        if len(messages) != 1:
            raise CallError(
                StatusCode.INVALID_ARGUMENT,
                f"a unary call carries exactly one request message, got {len(messages)}",
            )
        return messages[0]

    async def messages(self) -> AsyncIterator[bytes]:
        """The request messages until the client closes its side (CallError for a bad one)."""
        while True:
            while not self._inbox:
                self._arrived.clear()
                await self._arrived.wait()
            item = self._inbox.popleft()
            self._ack()
            if item is _END:
                return
            if isinstance(item, CallError):
                raise item
            assert isinstance(item, bytes)
            yield item

    async def send_message(self, message: bytes) -> None:
        """One response, split to fit the peer's window and frame size."""
        data = memoryview(frame(message))
        while data:
            if self.ended:
                raise asyncio.CancelledError("the call has ended")
            await self._link.writable()
            connection = self._link.http2
            try:
                window = connection.local_flow_control_window(self.stream_id)
                if window <= 0:
                    self._window.clear()
                    await self._window.wait()
                    continue
                size = min(window, connection.max_outbound_frame_size, len(data))
                self._send_headers()
                connection.send_data(self.stream_id, data[:size].tobytes())
            except http2.StreamClosedError:  # reset, its event not yet handled
                self.closed(by_peer=True)
                raise asyncio.CancelledError("the client reset the call") from None
            data = data[size:]
            self._link.flush_soon()

    def finish(self, code: StatusCode, message: str, metadata: Metadata) -> None:
        """End the call with its status (trailers only if nothing was sent)."""
        if self.ended:
            return
        self.ended = True
        trailers = status_trailers(code, message, metadata)
        if not self._headers_sent:
            trailers = RESPONSE_HEADERS + trailers
        try:
            self._link.http2.send_headers(self.stream_id, trailers, end_stream=True)
            if not self.remote_ended:  # stop a client still sending (gRPC's convention)
                self._link.http2.reset_stream(self.stream_id, http2.ErrorCode.NO_ERROR)
        except http2.StreamClosedError:
            return
        self._link.flush_soon()

    def _send_headers(self) -> None:
        if not self._headers_sent:
            self._headers_sent = True
            self._link.http2.send_headers(self.stream_id, RESPONSE_HEADERS)

    def _ack(self) -> None:
        if self._unacked:
            self._link.http2.acknowledge_received_data(self._unacked, self.stream_id)
            self._unacked = 0
            self._link.flush_soon()
