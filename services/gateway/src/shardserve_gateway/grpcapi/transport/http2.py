"""The server's side of HTTP/2 (RFC 9113) as a gRPC server needs it, sans I/O: bytes in,
events out; calls' headers, data and resets in, bytes to send out.

Why our own and not h2's state machine: h2 is general (client and server, push,
priorities, every validation, a logger call per frame) and cost 120-150 us of CPU for one
8 KiB unary call on this gateway, against aiohttp's C HTTP/1.1 parser's few; that was most
of the gap between gRPC and the REST binary path (docs/performance.md, issue 38). A gRPC
server needs less: client-opened streams, HEADERS (+CONTINUATION), DATA with padding and
flow control both ways, SETTINGS, PING, WINDOW_UPDATE, RST_STREAM, GOAWAY; priorities are
read and ignored, push is never used. What a client may get wrong is checked as the RFC
says: a connection error ends in GOAWAY (``ProtocolError``), a stream error in RST_STREAM.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

from shardserve_gateway.grpcapi.transport.header_codec import (
    Header,
    HeaderBlockError,
    HeaderDecoder,
    encode_headers,
)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DEFAULT_WINDOW = 65535
DEFAULT_FRAME_BYTES = 16384
MAX_WINDOW = 2**31 - 1
MAX_FRAME_LIMIT = 2**24 - 1
_HEAD = struct.Struct(">I")  # a frame's length (3 bytes after a zero) and stream ids


class FrameType(IntEnum):
    DATA = 0
    HEADERS = 1
    PRIORITY = 2
    RST_STREAM = 3
    SETTINGS = 4
    PUSH_PROMISE = 5
    PING = 6
    GOAWAY = 7
    WINDOW_UPDATE = 8
    CONTINUATION = 9


class Setting(IntEnum):
    HEADER_TABLE_SIZE = 1
    ENABLE_PUSH = 2
    MAX_CONCURRENT_STREAMS = 3
    INITIAL_WINDOW_SIZE = 4
    MAX_FRAME_SIZE = 5
    MAX_HEADER_LIST_SIZE = 6


class ErrorCode(IntEnum):
    NO_ERROR = 0
    PROTOCOL_ERROR = 1
    INTERNAL_ERROR = 2
    FLOW_CONTROL_ERROR = 3
    STREAM_CLOSED = 5
    FRAME_SIZE_ERROR = 6
    REFUSED_STREAM = 7
    CANCEL = 8
    COMPRESSION_ERROR = 9


END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20


class ProtocolError(Exception):
    """The client broke HTTP/2: the connection ends with GOAWAY ``code``."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class StreamClosedError(Exception):
    """A write to a stream that is closed (reset by the client, or already ended)."""


class _StreamError(Exception):
    def __init__(self, code: ErrorCode) -> None:
        self.code = code


# -- events -----------------------------------------------------------------------------


@dataclass(slots=True)
class RequestReceived:
    stream_id: int
    headers: list[Header]
    too_large: bool  # the header list is past what our SETTINGS allow


@dataclass(slots=True)
class DataReceived:
    stream_id: int
    data: bytes
    flow_controlled_length: int  # with padding: what acknowledge_received_data hands back


@dataclass(slots=True)
class StreamEnded:
    stream_id: int


@dataclass(slots=True)
class StreamReset:
    stream_id: int


@dataclass(slots=True)
class WindowUpdated:
    stream_id: int  # 0: the connection's window, or every stream's (new initial window)


@dataclass(slots=True)
class ConnectionTerminated:
    error_code: int


Event = (
    RequestReceived
    | DataReceived
    | StreamEnded
    | StreamReset
    | WindowUpdated
    | ConnectionTerminated
)


@dataclass(frozen=True)
class LocalSettings:
    """What we announce: receive windows, frame size, streams and header list size."""

    window: int
    frame_bytes: int
    max_streams: int
    header_list_bytes: int


class _Stream:
    __slots__ = ("in_open", "out_open", "out_window", "in_window", "in_unacked")

    def __init__(self, out_window: int, in_window: int) -> None:
        self.in_open = True  # the client may still send
        self.out_open = True  # we may still send
        self.out_window = out_window
        self.in_window = in_window
        self.in_unacked = 0


class ServerConnection:
    """One connection's HTTP/2 state, server side."""

    def __init__(self, settings: LocalSettings) -> None:
        self._local = settings
        self._decoder = HeaderDecoder()
        self._buffer = bytearray()
        self._out = bytearray()
        self._preface_seen = False
        self._closed = False
        self._streams: dict[int, _Stream] = {}
        self._highest_id = 0
        self._continuing: tuple[int, int, bytearray] | None = None  # stream, flags, block
        self._peer_initial_window = DEFAULT_WINDOW
        self.max_outbound_frame_size = DEFAULT_FRAME_BYTES
        self._out_window = DEFAULT_WINDOW
        self._in_window = DEFAULT_WINDOW
        self._in_unacked = 0

    # -- starting and ending -------------------------------------------------------

    def initiate(self) -> None:
        """Our SETTINGS and the connection window we grant (sent first, as servers do)."""
        local = self._local
        values = (
            (Setting.ENABLE_PUSH, 0),
            (Setting.MAX_CONCURRENT_STREAMS, local.max_streams),
            (Setting.INITIAL_WINDOW_SIZE, local.window),
            (Setting.MAX_FRAME_SIZE, local.frame_bytes),
            (Setting.MAX_HEADER_LIST_SIZE, local.header_list_bytes),
        )
        self._frame(FrameType.SETTINGS, 0, 0, b"".join(struct.pack(">HI", *v) for v in values))
        if local.window > DEFAULT_WINDOW:
            self._window_update(0, local.window - DEFAULT_WINDOW)
            self._in_window = local.window

    def close_connection(self, code: ErrorCode = ErrorCode.NO_ERROR) -> None:
        """GOAWAY naming the last stream we saw; nothing more is read or written after."""
        if not self._closed:
            self._closed = True
            self._frame(FrameType.GOAWAY, 0, 0, struct.pack(">II", self._highest_id, code))

    def data_to_send(self) -> bytes:
        data = bytes(self._out)
        self._out.clear()
        return data

    # -- reading ---------------------------------------------------------------------

    def receive_data(self, data: bytes) -> list[Event]:
        """The events ``data`` completes; ProtocolError (GOAWAY queued) if it breaks HTTP/2."""
        if self._closed:
            return []
        self._buffer += data
        events: list[Event] = []
        try:
            self._read_frames(events)
        except ProtocolError as exc:
            self.close_connection(exc.code)
            raise
        return events

    def _read_frames(self, events: list[Event]) -> None:
        buffer = self._buffer
        pos = 0
        if not self._preface_seen:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(bytes(buffer)):
                    raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "not the HTTP/2 preface")
                return
            if buffer[: len(PREFACE)] != PREFACE:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "not the HTTP/2 preface")
            self._preface_seen = True
            pos = len(PREFACE)
        limit = self._local.frame_bytes
        with memoryview(buffer) as view:  # a payload is copied once, out of the view
            while len(buffer) - pos >= 9 and not self._closed:
                length = _HEAD.unpack_from(buffer, pos)[0] >> 8
                if length > limit:
                    raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, f"a {length}-byte frame")
                end = pos + 9 + length
                if len(buffer) < end:
                    break
                kind, flags = buffer[pos + 3], buffer[pos + 4]
                stream_id = _HEAD.unpack_from(buffer, pos + 5)[0] & MAX_WINDOW
                payload = bytes(view[pos + 9 : end])
                pos = end
                self._on_frame(kind, flags, stream_id, payload, events)
        del buffer[:pos]

    def _on_frame(
        self, kind: int, flags: int, stream_id: int, payload: bytes, events: list[Event]
    ) -> None:
        if self._continuing is not None and (
            kind != FrameType.CONTINUATION or stream_id != self._continuing[0]
        ):
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "a header block was interrupted")
        handler = _HANDLERS.get(kind)
        if handler is None:
            return  # unknown frame types are ignored (RFC 9113 5.5)
        try:
            handler(self, flags, stream_id, payload, events)
        except _StreamError as exc:
            if stream_id in self._streams:
                events.append(StreamReset(stream_id))
            self.reset_stream(stream_id, exc.code)

    def _on_data(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if stream_id == 0:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        flow = len(payload)
        if flow > self._in_window:
            raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, "DATA past the connection window")
        self._in_window -= flow
        data = _unpad(flags, payload)
        stream = self._streams.get(stream_id)
        if stream is None or not stream.in_open:
            self._credit(flow)  # nobody will read it: the window comes back at once
            if stream_id > self._highest_id:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "DATA on an idle stream")
            if stream is None:
                return  # in flight when we reset or ended the stream: ignored (RFC 9113 5.4.2)
            raise _StreamError(ErrorCode.STREAM_CLOSED)
        if flow > stream.in_window:
            self._credit(flow)
            raise _StreamError(ErrorCode.FLOW_CONTROL_ERROR)
        stream.in_window -= flow
        events.append(DataReceived(stream_id, data, flow))
        if flags & END_STREAM:
            self._remote_end(stream_id, stream, events)

    def _on_headers(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if stream_id == 0 or stream_id % 2 == 0:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"HEADERS on stream {stream_id}")
        fragment = _unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            if len(fragment) < 5:
                raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "a short priority field")
            fragment = fragment[5:]
        self._continuing = (stream_id, flags, bytearray(fragment))
        if flags & END_HEADERS:
            self._end_of_block(events)

    def _on_continuation(
        self, flags: int, stream_id: int, payload: bytes, events: list[Event]
    ) -> None:
        if self._continuing is None:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "CONTINUATION without HEADERS")
        block = self._continuing[2]
        block += payload
        # Bounded: a block may be larger than the list it encodes only by its framing.
        if len(block) > 2 * self._local.header_list_bytes:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "a header block past the limit")
        if flags & END_HEADERS:
            self._end_of_block(events)

    def _end_of_block(self, events: list[Event]) -> None:
        assert self._continuing is not None
        stream_id, flags, block = self._continuing
        self._continuing = None
        try:
            headers, list_size = self._decoder.decode(bytes(block))
        except HeaderBlockError as exc:
            raise ProtocolError(ErrorCode.COMPRESSION_ERROR, str(exc)) from None
        stream = self._streams.get(stream_id)
        if stream is not None:  # trailers from the client: gRPC sends none; its end counts
            if not stream.in_open:
                raise _StreamError(ErrorCode.STREAM_CLOSED)
            if flags & END_STREAM:
                self._remote_end(stream_id, stream, events)
            return
        if stream_id <= self._highest_id:
            return  # trailers of a stream we already closed: ignored, as its DATA
        self._highest_id = stream_id
        if len(self._streams) >= self._local.max_streams:
            raise _StreamError(ErrorCode.REFUSED_STREAM)
        stream = _Stream(self._peer_initial_window, self._local.window)
        self._streams[stream_id] = stream
        too_large = list_size > self._local.header_list_bytes
        events.append(RequestReceived(stream_id, [] if too_large else headers, too_large))
        if flags & END_STREAM:
            self._remote_end(stream_id, stream, events)

    def _on_priority(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if stream_id == 0:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "PRIORITY on stream 0")
        if len(payload) != 5:
            raise _StreamError(ErrorCode.FRAME_SIZE_ERROR)

    def _on_rst_stream(
        self, flags: int, stream_id: int, payload: bytes, events: list[Event]
    ) -> None:
        if len(payload) != 4:
            raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "RST_STREAM of the wrong size")
        if stream_id == 0 or stream_id > self._highest_id:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "RST_STREAM on an idle stream")
        if self._streams.pop(stream_id, None) is not None:
            events.append(StreamReset(stream_id))

    def _on_settings(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if stream_id:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "a SETTINGS ack with a body")
            return
        if len(payload) % 6:
            raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS of the wrong size")
        for offset in range(0, len(payload), 6):
            code, value = struct.unpack_from(">HI", payload, offset)
            self._apply_setting(code, value, events)
        self._frame(FrameType.SETTINGS, ACK, 0, b"")

    def _apply_setting(self, code: int, value: int, events: list[Event]) -> None:
        if code == Setting.ENABLE_PUSH and value > 1:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "ENABLE_PUSH must be 0 or 1")
        if code == Setting.INITIAL_WINDOW_SIZE:
            if value > MAX_WINDOW:
                raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, "an initial window past 2^31-1")
            delta = value - self._peer_initial_window
            self._peer_initial_window = value
            for stream in self._streams.values():
                stream.out_window += delta
                if stream.out_window > MAX_WINDOW:
                    raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, "a stream window overflowed")
            events.append(WindowUpdated(0))
        elif code == Setting.MAX_FRAME_SIZE:
            if not DEFAULT_FRAME_BYTES <= value <= MAX_FRAME_LIMIT:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value}")
            self.max_outbound_frame_size = value
        # The others do not bind us: our header blocks use no table, we push nothing, and
        # the client opens the streams.

    def _on_ping(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if stream_id:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "PING of the wrong size")
        if not flags & ACK:
            self._frame(FrameType.PING, ACK, 0, payload)

    def _on_goaway(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if stream_id:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "GOAWAY on a stream")
        if len(payload) < 8:
            raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "a short GOAWAY")
        events.append(ConnectionTerminated(struct.unpack_from(">I", payload, 4)[0]))

    def _on_window_update(
        self, flags: int, stream_id: int, payload: bytes, events: list[Event]
    ) -> None:
        if len(payload) != 4:
            raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        increment = _HEAD.unpack(payload)[0] & MAX_WINDOW
        if stream_id == 0:
            if increment == 0:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "a zero window increment")
            self._out_window += increment
            if self._out_window > MAX_WINDOW:
                raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, "the window overflowed")
        else:
            stream = self._streams.get(stream_id)
            if stream is None:
                if stream_id > self._highest_id:
                    raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
                return  # a closed stream's: allowed, and nothing to do
            if increment == 0:
                raise _StreamError(ErrorCode.PROTOCOL_ERROR)
            stream.out_window += increment
            if stream.out_window > MAX_WINDOW:
                raise _StreamError(ErrorCode.FLOW_CONTROL_ERROR)
        events.append(WindowUpdated(stream_id))

    def _on_push_promise(
        self, flags: int, stream_id: int, payload: bytes, events: list[Event]
    ) -> None:
        raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "a client sent PUSH_PROMISE")

    def _remote_end(self, stream_id: int, stream: _Stream, events: list[Event]) -> None:
        stream.in_open = False
        events.append(StreamEnded(stream_id))
        if not stream.out_open:
            del self._streams[stream_id]

    # -- writing ---------------------------------------------------------------------

    def send_headers(
        self, stream_id: int, headers: list[tuple[str, str]], *, end_stream: bool = False
    ) -> None:
        """HEADERS (+CONTINUATION) for the response or its trailers."""
        stream = self._open_stream(stream_id)
        block = _encoded(tuple(headers))
        size = self.max_outbound_frame_size
        flags = END_STREAM if end_stream else 0
        first, rest = block[:size], block[size:]
        self._frame(FrameType.HEADERS, flags | (0 if rest else END_HEADERS), stream_id, first)
        while rest:
            chunk, rest = rest[:size], rest[size:]
            self._frame(FrameType.CONTINUATION, 0 if rest else END_HEADERS, stream_id, chunk)
        if end_stream:
            self._local_end(stream_id, stream)

    def send_data(self, stream_id: int, data: bytes, *, end_stream: bool = False) -> None:
        """One DATA frame: within ``local_flow_control_window`` and the frame size."""
        stream = self._open_stream(stream_id)
        size = len(data)
        if size > min(self._out_window, stream.out_window) or size > self.max_outbound_frame_size:
            raise ValueError(f"{size} bytes exceed the window or the frame size")
        self._out_window -= size
        stream.out_window -= size
        self._frame(FrameType.DATA, END_STREAM if end_stream else 0, stream_id, data)
        if end_stream:
            self._local_end(stream_id, stream)

    def reset_stream(self, stream_id: int, code: ErrorCode = ErrorCode.CANCEL) -> None:
        self._streams.pop(stream_id, None)
        self._frame(FrameType.RST_STREAM, 0, stream_id, struct.pack(">I", code))

    def local_flow_control_window(self, stream_id: int) -> int:
        return min(self._out_window, self._open_stream(stream_id).out_window)

    def acknowledge_received_data(self, length: int, stream_id: int) -> None:
        """``length`` bytes of the stream's DATA were consumed: the client may send more.

        Windows are given back in batches once half of one is used, as h2 and grpc do."""
        self._credit(length)
        stream = self._streams.get(stream_id)
        if stream is None or not stream.in_open:
            return  # it sends nothing more on that stream
        stream.in_unacked += length
        if stream.in_unacked >= self._local.window // 2:
            self._window_update(stream_id, stream.in_unacked)
            stream.in_window += stream.in_unacked
            stream.in_unacked = 0

    def _credit(self, length: int) -> None:
        self._in_unacked += length
        if self._in_unacked >= self._local.window // 2:
            self._window_update(0, self._in_unacked)
            self._in_window += self._in_unacked
            self._in_unacked = 0

    def _open_stream(self, stream_id: int) -> _Stream:
        stream = self._streams.get(stream_id)
        if stream is None or not stream.out_open or self._closed:
            raise StreamClosedError(f"stream {stream_id} is closed")
        return stream

    def _local_end(self, stream_id: int, stream: _Stream) -> None:
        stream.out_open = False
        if not stream.in_open:
            del self._streams[stream_id]

    def _window_update(self, stream_id: int, increment: int) -> None:
        self._frame(FrameType.WINDOW_UPDATE, 0, stream_id, struct.pack(">I", increment))

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        self._out += frame_head(kind, flags, stream_id, len(payload))
        self._out += payload


def frame_head(kind: int, flags: int, stream_id: int, length: int) -> bytes:
    """The 9 bytes before a frame's ``length``-byte payload."""
    return _HEAD.pack(length << 8 | kind) + bytes((flags,)) + _HEAD.pack(stream_id)


@functools.lru_cache(maxsize=128)
def _encoded(headers: tuple[tuple[str, str], ...]) -> bytes:
    """A header list's block: the constant lists a server sends (response headers, an OK
    status) stay here, encoded once; lists unique to a call pass through."""
    return encode_headers(headers)


def _unpad(flags: int, payload: bytes) -> bytes:
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "padding past the frame's end")
    return payload[1 : len(payload) - payload[0]]


_Handler = Callable[[ServerConnection, int, int, bytes, list[Event]], None]
_HANDLERS: dict[int, _Handler] = {
    FrameType.DATA: ServerConnection._on_data,
    FrameType.HEADERS: ServerConnection._on_headers,
    FrameType.PRIORITY: ServerConnection._on_priority,
    FrameType.RST_STREAM: ServerConnection._on_rst_stream,
    FrameType.SETTINGS: ServerConnection._on_settings,
    FrameType.PUSH_PROMISE: ServerConnection._on_push_promise,
    FrameType.PING: ServerConnection._on_ping,
    FrameType.GOAWAY: ServerConnection._on_goaway,
    FrameType.WINDOW_UPDATE: ServerConnection._on_window_update,
    FrameType.CONTINUATION: ServerConnection._on_continuation,
}
