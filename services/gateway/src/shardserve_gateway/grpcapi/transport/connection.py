"""One client's HTTP/2 connection: our HTTP/2 state machine (``http2``) fed from the
socket on the event loop, one task per call (owned here, cancelled when the client resets
the stream, the deadline passes or the connection goes), and the writes of every call in a
loop turn sent together.

Requests that cannot be a call of ours are answered from their headers, with no task:
not POST (HTTP 405), not ``application/grpc`` (HTTP 415, as the gRPC spec asks), an
unknown method (UNIMPLEMENTED), a malformed ``grpc-timeout`` or an unsupported
``grpc-encoding``. A peer that breaks HTTP/2 gets GOAWAY and the connection closes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast

from shardserve.process.waits import set_within
from shardserve_gateway.errors import INTERNAL_MESSAGE
from shardserve_gateway.grpcapi.transport import http2
from shardserve_gateway.grpcapi.transport.context import AbortError, CallContext
from shardserve_gateway.grpcapi.transport.stream import RESPONSE_HEADERS, ServerStream
from shardserve_gateway.grpcapi.transport.wire import (
    CallError,
    MessageReader,
    Metadata,
    StatusCode,
    metadata_of,
    parse_timeout,
    status_trailers,
)

_logger = logging.getLogger(__name__)


CallHandler = Callable[[ServerStream, CallContext], Awaitable[None]]
Router = Callable[[str], CallHandler | None]
Ending = tuple[StatusCode, str, Metadata]  # a status, its message, trailing metadata
# Our side's HTTP/2 settings: windows and frames large enough that a 16 MiB tensor takes
# a handful of events, streams enough for a client's whole pipeline.
WINDOW_BYTES = 8 * 1024 * 1024
FRAME_BYTES = 1024 * 1024
MAX_STREAMS = 1024
HEADER_LIST_BYTES = 64 * 1024


@dataclass(frozen=True)
class CallLimits:
    """What every call on the port may send."""

    message_bytes: int


class GrpcConnection(asyncio.Protocol):
    """Serves the calls of one connection through ``route``."""

    def __init__(
        self, route: Router, limits: CallLimits, on_lost: Callable[[GrpcConnection], None]
    ) -> None:
        # Header values are not validated by the HTTP/2 layer (grpc's own server takes a
        # metadata value with surrounding spaces): the headers a call needs are checked
        # here instead, and a bad one ends only its call.
        self.http2 = http2.ServerConnection(
            http2.LocalSettings(WINDOW_BYTES, FRAME_BYTES, MAX_STREAMS, HEADER_LIST_BYTES)
        )
        self._route = route
        self._limits = limits
        self._on_lost = on_lost
        self._transport: asyncio.Transport | None = None
        self._streams: dict[int, ServerStream] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._flush_pending = False
        self._writable = asyncio.Event()
        self._writable.set()
        self._lost = asyncio.Event()

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.http2.initiate()
        self._flush()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.http2.receive_data(data)
        except http2.ProtocolError as exc:
            _logger.info("closing a gRPC connection that broke HTTP/2: %s", exc)
            self._flush()
            self.close()
            return
        for event in events:
            self._handle(event)
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self._writable.set()
        for stream in self._streams.values():
            stream.closed(by_peer=True)
        for task in self._tasks.values():
            task.cancel()
        self._lost.set()
        self._on_lost(self)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # -- what streams use (stream.Link) ---------------------------------------------

    def flush_soon(self) -> None:
        """Write what the HTTP/2 state holds once this loop turn's calls have added theirs."""
        if not self._flush_pending:
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self._flush)

    async def writable(self) -> None:
        await self._writable.wait()

    # -- the server's side -----------------------------------------------------------

    def close(self, ending: Ending | None = None) -> None:
        """GOAWAY, then close; the calls still open are cancelled (by connection_lost), and
        with ``ending`` each is first ended with that status, so its client learns why."""
        if self._transport is None or self._transport.is_closing():
            return
        if ending is not None:
            for stream in self._streams.values():
                stream.finish(*ending)
        self.http2.close_connection()
        self._flush()
        self._transport.close()

    async def wait_closed(self, seconds: float) -> None:
        """Until the socket is closed (its pending answers written), aborting it after
        ``seconds``: the transport's close completes on a later loop turn, and a server
        stopped before it leaves the socket open."""
        if not await set_within(self._lost, seconds) and self._transport is not None:
            self._transport.abort()
        await self._lost.wait()

    async def wait_calls(self) -> None:
        """Until every call task has ended."""
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()))

    # -- events ----------------------------------------------------------------------

    def _handle(self, event: http2.Event) -> None:
        match event:
            case http2.DataReceived(stream_id, data, flow_length):
                stream = self._streams.get(stream_id)
                if stream is None:  # already answered: hand the window back, drop the data
                    self.http2.acknowledge_received_data(flow_length, stream_id)
                else:
                    stream.received(data, flow_length)
            case http2.RequestReceived(stream_id, headers, too_large):
                if too_large:
                    message = f"the request's headers exceed {HEADER_LIST_BYTES} bytes"
                    self._refuse(stream_id, CallError(StatusCode.RESOURCE_EXHAUSTED, message))
                else:
                    self._start_call(stream_id, headers)
            case http2.StreamEnded(stream_id):
                if (stream := self._streams.get(stream_id)) is not None:
                    stream.remote_end()
            case http2.WindowUpdated(stream_id):
                self._window_opened(stream_id)
            case http2.StreamReset(stream_id):
                self._reset(stream_id)
            case http2.ConnectionTerminated():
                self.close()

    def _window_opened(self, stream_id: int) -> None:
        if stream_id:
            if (stream := self._streams.get(stream_id)) is not None:
                stream.window_opened()
            return
        for stream in self._streams.values():
            stream.window_opened()

    def _reset(self, stream_id: int) -> None:
        stream = self._streams.get(stream_id)
        if stream is not None:
            stream.closed(by_peer=True)
            self._tasks[stream_id].cancel()

    def _start_call(self, stream_id: int, raw_headers: list[tuple[bytes, bytes]]) -> None:
        headers = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in raw_headers]
        fields = dict(headers)
        refusal = _refusal(fields)
        if refusal is not None:
            self._answer(stream_id, refusal)
            return
        handler = self._route(fields.get(":path", ""))
        if handler is None:
            path = fields.get(":path")
            self._refuse(
                stream_id, CallError(StatusCode.UNIMPLEMENTED, f"Method not found: {path}")
            )
            return
        try:
            timeout = fields.get("grpc-timeout")
            deadline = None if timeout is None else time.monotonic() + parse_timeout(timeout)
            reader = MessageReader(self._limits.message_bytes, fields.get("grpc-encoding"))
            metadata = metadata_of(headers)
        except CallError as exc:
            self._refuse(stream_id, exc)
            return
        stream = ServerStream(self, stream_id, reader)
        self._streams[stream_id] = stream
        context = CallContext(stream, metadata, deadline)
        task = asyncio.get_running_loop().create_task(self._serve(stream, context, handler))
        self._tasks[stream_id] = task
        task.add_done_callback(lambda _: self._forget(stream_id))
        if deadline is not None:
            self._arm_deadline(stream, task, deadline)

    def _refuse(self, stream_id: int, error: CallError) -> None:
        """End a call its headers make impossible with the status ``error`` names."""
        self._answer(stream_id, RESPONSE_HEADERS + status_trailers(error.code, error.message, ()))

    def _answer(self, stream_id: int, headers: list[tuple[str, str]]) -> None:
        """The whole answer to a call refused from its headers (unless already reset)."""
        try:
            self.http2.send_headers(stream_id, headers, end_stream=True)
        except http2.StreamClosedError:
            pass

    def _arm_deadline(
        self, stream: ServerStream, task: asyncio.Task[None], deadline: float
    ) -> None:
        def expire() -> None:
            if not task.done():
                stream.deadline_passed = True
                task.cancel()

        handle = asyncio.get_running_loop().call_later(deadline - time.monotonic(), expire)
        task.add_done_callback(lambda _: handle.cancel())

    def _forget(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)
        self._tasks.pop(stream_id, None)

    async def _serve(
        self, stream: ServerStream, context: CallContext, handler: CallHandler
    ) -> None:
        """Run the call and end it with exactly one status."""
        try:
            await handler(stream, context)
        except AbortError:
            pass
        except CallError as exc:
            context.code, context.details = exc.code, exc.message
        except asyncio.CancelledError:
            if not stream.deadline_passed:
                return  # reset by the client, connection lost or server stopping: no one to tell
            context.code, context.details = StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        except Exception:
            _logger.exception("internal error in a gRPC call")
            context.code, context.details = StatusCode.INTERNAL, INTERNAL_MESSAGE
        stream.finish(context.code, context.details, context.trailing_metadata)

    def _flush(self) -> None:
        self._flush_pending = False
        data = self.http2.data_to_send()
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)


def _refusal(fields: dict[str, str]) -> list[tuple[str, str]] | None:
    """The whole answer to a request that is not a gRPC call, or None."""
    if fields.get(":method") != "POST":
        return [(":status", "405"), ("grpc-status", str(int(StatusCode.UNIMPLEMENTED)))]
    content_type = fields.get("content-type", "")
    if not (
        content_type == "application/grpc"
        or content_type.startswith(("application/grpc+", "application/grpc;"))
    ):
        return [(":status", "415"), ("grpc-status", str(int(StatusCode.UNKNOWN)))]
    return None
