"""AMQP 0-9-1 frames for the lean connection (``shardserve.amqp.lean``), pure.

The hot frames are cut and built here by hand: a ``Basic.Deliver`` is recognised by its
first four bytes, a content header read for its body size and property flags only, a
publish built from a cached method frame. Every other frame (the handshake, declares,
closes: a few per connection) goes through pamqp, the codec aiormq uses.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from pamqp import base, commands
from pamqp import frame as pamqp_frame
from pamqp import header as pamqp_header

from shardserve.errors import ShardserveError

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
METHOD, HEADER, BODY, HEARTBEAT = 1, 2, 3, 8
FRAME_END = b"\xce"
_HEAD = struct.Struct(">BHI")  # type, channel, payload size
_OVERHEAD = _HEAD.size + 1  # head + frame end
DELIVER_ID = struct.pack(">HH", 60, 60)  # Basic.Deliver: class 60, method 60
_PUBLISH_ID = struct.pack(">HHH", 60, 40, 0)  # Basic.Publish + its reserved short
_CONTENT_HEAD = struct.Struct(">HHQ")  # class 60, weight 0, body size
NO_PROPERTIES = b"\x00\x00"  # property flags: none set
HEARTBEAT_FRAME = _HEAD.pack(HEARTBEAT, 0, 0) + FRAME_END


class FrameError(ShardserveError):
    """Bytes from the broker that are no AMQP frame (the connection is beyond saving)."""


@dataclass(frozen=True, slots=True)
class Frame:
    kind: int  # METHOD, HEADER, BODY or HEARTBEAT
    channel: int
    payload: bytes


class FrameReader:
    """Cuts the bytes of a connection into frames, however the reads split them."""

    def __init__(self, max_frame: int) -> None:
        self._buffer = bytearray()
        self.max_frame = max_frame  # payload bytes, raised to the tuned frame_max

    def feed(self, data: bytes) -> list[Frame]:
        """The frames completed by ``data`` (a partial one is kept for the next feed)."""
        buffer = self._buffer
        buffer += data
        frames: list[Frame] = []
        at = 0
        while len(buffer) - at >= _OVERHEAD:
            kind, channel, size = _HEAD.unpack_from(buffer, at)
            if size > self.max_frame:
                raise FrameError(f"frame of {size} bytes exceeds frame_max {self.max_frame}")
            end = at + _HEAD.size + size
            if len(buffer) <= end:
                break
            if buffer[end] != 0xCE:
                raise FrameError(f"frame of type {kind} does not end with 0xce")
            frames.append(Frame(kind, channel, _copy(buffer, at + _HEAD.size, end)))
            at = end + 1
        del buffer[:at]
        return frames


def _copy(buffer: bytearray, start: int, end: int) -> bytes:
    # One copy (a bytearray slice would be a second); the view is released at once, or
    # the buffer could not shrink.
    with memoryview(buffer) as view:
        return view[start:end].tobytes()


def is_deliver(frame: Frame) -> bool:
    return frame.kind == METHOD and frame.payload[:4] == DELIVER_ID


def content_size(payload: bytes) -> tuple[int, bool]:
    """A content header's body size, and whether it carries any property."""
    _, _, size = _CONTENT_HEAD.unpack_from(payload)
    return size, payload[12:14] != NO_PROPERTIES


def properties_of(payload: bytes) -> commands.Basic.Properties:
    """A content header's properties (the slow path: pamqp reads them)."""
    content = pamqp_header.ContentHeader()
    content.unmarshal(payload)
    return content.properties


def method_of(frame: Frame) -> base.Frame:
    """A method frame's method, read by pamqp."""
    raw = _HEAD.pack(METHOD, frame.channel, len(frame.payload)) + frame.payload + FRAME_END
    _, _, method = pamqp_frame.unmarshal(raw)
    assert isinstance(method, base.Frame)
    return method


def method_frame(channel: int, method: base.Frame) -> bytes:
    return pamqp_frame.marshal(method, channel)


def publish_method(channel: int, exchange: str, routing_key: str) -> bytes:
    """The Basic.Publish frame (not mandatory, not immediate) for a destination."""
    payload = _PUBLISH_ID + _short(exchange) + _short(routing_key) + b"\x00"
    return _HEAD.pack(METHOD, channel, len(payload)) + payload + FRAME_END


def content_frames(
    channel: int,
    pieces: Sequence[bytes | memoryview],
    frame_max: int,
    properties: bytes = NO_PROPERTIES,
) -> list[bytes | memoryview]:
    """The header frame and the body frames of a message whose body is ``pieces``
    joined; ``properties``: flags and fields as ``Basic.Properties.marshal`` writes them.
    A body that fits one frame stays in its pieces (the caller's join is its one copy)."""
    size = sum(len(p) for p in pieces)
    header = _CONTENT_HEAD.pack(60, 0, size) + properties
    frames: list[bytes | memoryview] = [_HEAD.pack(HEADER, channel, len(header)), header]
    frames.append(FRAME_END)
    room = frame_max - _OVERHEAD
    if 0 < size <= room:
        return [*frames, _HEAD.pack(BODY, channel, size), *pieces, FRAME_END]
    view = memoryview(pieces[0] if len(pieces) == 1 else b"".join(pieces))
    for at in range(0, size, room):
        chunk = view[at : at + room]
        frames += [_HEAD.pack(BODY, channel, len(chunk)), chunk, FRAME_END]
    return frames


def _short(text: str) -> bytes:
    raw = text.encode()
    if len(raw) > 255:
        raise ValueError(f"AMQP short string of {len(raw)} bytes: {text[:40]!r}...")
    return bytes([len(raw)]) + raw
