"""The gRPC port's HTTP/2 layer (transport/http2, transport/header_codec), sans I/O.

h2's client side is the well-kept peer: whatever it writes (HPACK with a dynamic table and
Huffman strings, flow control, trailers) our server must read, and whatever we write it
must accept. The RFC's own cases check the errors, and hypothesis throws arbitrary frames
at the server: a ProtocolError (GOAWAY) or events, nothing else.
"""

from __future__ import annotations

import struct

import h2.config
import h2.connection
import h2.events
import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve_gateway.grpcapi.transport import http2
from shardserve_gateway.grpcapi.transport.header_codec import (
    HeaderBlockError,
    HeaderDecoder,
    encode_headers,
)

LOCAL = http2.LocalSettings(
    window=1 << 20, frame_bytes=1 << 16, max_streams=4, header_list_bytes=4096
)
REQUEST = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/inference.GRPCInferenceService/ModelInfer"),
    (":authority", "localhost:8001"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
    ("user-agent", "grpc-python/1.7 grpc-c/37.0.0 (linux; chttp2)"),
]


def frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return http2.frame_head(kind, flags, stream_id, len(payload)) + payload


class Pair:
    """An h2 client and our server, bytes carried between them by hand."""

    def __init__(self, local: http2.LocalSettings = LOCAL) -> None:
        self.client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.server = http2.ServerConnection(local)
        self.server.initiate()
        self.client.initiate_connection()

    def to_server(self) -> list[http2.Event]:
        return self.server.receive_data(self.client.data_to_send())

    def to_client(self) -> list[h2.events.Event]:
        return self.client.receive_data(self.server.data_to_send())

    def exchange(self) -> list[http2.Event]:
        """Both ways until quiet; the server's events."""
        events: list[http2.Event] = []
        for _ in range(8):
            events += self.to_server()
            self.to_client()
        return events


def test_a_unary_call_both_ways_through_h2() -> None:
    pair = Pair()
    pair.exchange()
    for stream_id in (1, 3, 5):  # later calls' headers come from the client's dynamic table
        pair.client.send_headers(stream_id, REQUEST)
        pair.client.send_data(stream_id, b"\0\0\0\0\x05hello", end_stream=True)
        events = pair.to_server()
        assert [type(e) for e in events] == [
            http2.RequestReceived,
            http2.DataReceived,
            http2.StreamEnded,
        ]
        request = events[0]
        assert isinstance(request, http2.RequestReceived)
        assert [(n.decode(), v.decode()) for n, v in request.headers] == REQUEST
        assert events[1] == http2.DataReceived(stream_id, b"\0\0\0\0\x05hello", 10)
        pair.server.send_headers(
            stream_id, [(":status", "200"), ("content-type", "application/grpc")]
        )
        pair.server.send_data(stream_id, b"\0\0\0\0\x02ok")
        pair.server.send_headers(stream_id, [("grpc-status", "0")], end_stream=True)
        answer = pair.to_client()
        kinds = [type(e) for e in answer]
        assert kinds[:3] == [
            h2.events.ResponseReceived,
            h2.events.DataReceived,
            h2.events.TrailersReceived,
        ]
        assert answer[-1].stream_id == stream_id and isinstance(answer[-1], h2.events.StreamEnded)
    assert not pair.server._streams  # every call ended on both sides


def test_flow_control_both_ways_past_the_default_windows() -> None:
    pair = Pair()
    pair.exchange()
    body = bytes(range(256)) * 8192  # 2 MiB each way: past 64 KiB and our 1 MiB window
    pair.client.send_headers(1, REQUEST)
    received = bytearray()
    sent = 0
    ended = False
    for _ in range(1000):
        window = pair.client.local_flow_control_window(1)
        chunk = body[sent : sent + min(window, pair.client.max_outbound_frame_size)]
        if chunk:
            pair.client.send_data(1, chunk, end_stream=sent + len(chunk) == len(body))
            sent += len(chunk)
        for event in pair.to_server():
            if isinstance(event, http2.DataReceived):
                received += event.data
                pair.server.acknowledge_received_data(event.flow_controlled_length, 1)
            ended = ended or isinstance(event, http2.StreamEnded)
        pair.to_client()
        if ended:
            break
    assert ended and bytes(received) == body
    pair.server.send_headers(1, [(":status", "200")])
    out = 0
    got = bytearray()
    for _ in range(1000):
        window = min(pair.server.local_flow_control_window(1), pair.server.max_outbound_frame_size)
        chunk = body[out : out + window]
        if chunk:
            pair.server.send_data(1, chunk)
            out += len(chunk)
        for event in pair.to_client():
            if isinstance(event, h2.events.DataReceived):
                got += event.data
                pair.client.acknowledge_received_data(event.flow_controlled_length, 1)
        pair.to_server()
        if out == len(body):
            break
    pair.to_client()
    assert bytes(got) == body


def test_sending_past_the_window_is_refused_until_it_opens() -> None:
    pair = Pair()
    pair.exchange()
    pair.client.send_headers(1, REQUEST, end_stream=True)
    pair.to_server()
    assert pair.server.local_flow_control_window(1) == 65535
    with pytest.raises(ValueError, match="exceed the window"):
        pair.server.send_data(1, b"x" * 65536)
    pair.client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 65535 + 10})
    events = pair.to_server()
    assert http2.WindowUpdated(0) in events
    assert pair.server.local_flow_control_window(1) == 65535  # the connection's window binds
    pair.client.increment_flow_control_window(100)
    pair.to_server()
    assert pair.server.local_flow_control_window(1) == 65545


def test_a_reset_by_the_client_ends_the_stream_for_writes() -> None:
    pair = Pair()
    pair.exchange()
    pair.client.send_headers(1, REQUEST)
    pair.to_server()
    pair.client.reset_stream(1)
    assert pair.to_server() == [http2.StreamReset(1)]
    with pytest.raises(http2.StreamClosedError):
        pair.server.send_headers(1, [(":status", "200")])


def test_ping_and_settings_are_acknowledged() -> None:
    pair = Pair()
    pair.exchange()
    pair.client.ping(b"12345678")
    pair.to_server()
    events = pair.to_client()
    assert any(
        isinstance(e, h2.events.PingAckReceived) and e.ping_data == b"12345678" for e in events
    )


def test_streams_past_the_limit_are_refused_and_the_others_go_on() -> None:
    pair = Pair()
    pair.exchange()
    for stream_id in (1, 3, 5, 7):
        pair.client.send_headers(stream_id, REQUEST)
    assert len(pair.to_server()) == 4
    raw = frame(http2.FrameType.HEADERS, http2.END_HEADERS, 9, encode_headers(REQUEST))
    assert pair.server.receive_data(raw) == []
    assert rst_codes(pair.server.data_to_send()) == [(9, http2.ErrorCode.REFUSED_STREAM)]


def test_headers_past_the_list_limit_are_flagged_for_a_refusal() -> None:
    server = started()
    block = encode_headers([*REQUEST, ("x-big", "v" * 5000)])
    events = server.receive_data(frame(http2.FrameType.HEADERS, 0, 1, block[:3000]))
    assert events == []
    events = server.receive_data(
        frame(http2.FrameType.CONTINUATION, http2.END_HEADERS, 1, block[3000:])
    )
    assert events == [http2.RequestReceived(1, [], too_large=True)]


def test_a_header_block_split_over_continuation_frames() -> None:
    server = started()
    block = encode_headers(REQUEST)
    frames = frame(
        http2.FrameType.HEADERS,
        http2.PADDED | http2.PRIORITY_FLAG,
        1,
        b"\x02" + b"\0" * 5 + block[:10] + b"\0\0",
    )
    frames += frame(http2.FrameType.CONTINUATION, 0, 1, block[10:20])
    frames += frame(http2.FrameType.CONTINUATION, http2.END_HEADERS, 1, block[20:])
    (request,) = server.receive_data(frames)
    assert isinstance(request, http2.RequestReceived)
    assert [(n.decode(), v.decode()) for n, v in request.headers] == REQUEST


GOAWAY_CASES = {
    "DATA on stream 0": (frame(http2.FrameType.DATA, 0, 0, b"x"), http2.ErrorCode.PROTOCOL_ERROR),
    "HEADERS on an even stream": (
        frame(http2.FrameType.HEADERS, http2.END_HEADERS, 2, encode_headers(REQUEST)),
        http2.ErrorCode.PROTOCOL_ERROR,
    ),
    "a frame past our size": (
        frame(http2.FrameType.DATA, 0, 1, b"x" * 70000),
        http2.ErrorCode.FRAME_SIZE_ERROR,
    ),
    "CONTINUATION alone": (
        frame(http2.FrameType.CONTINUATION, http2.END_HEADERS, 1, b""),
        http2.ErrorCode.PROTOCOL_ERROR,
    ),
    "an interrupted header block": (
        frame(http2.FrameType.HEADERS, 0, 1, b"") + frame(http2.FrameType.PING, 0, 0, b"\0" * 8),
        http2.ErrorCode.PROTOCOL_ERROR,
    ),
    "a zero connection window increment": (
        frame(http2.FrameType.WINDOW_UPDATE, 0, 0, b"\0\0\0\0"),
        http2.ErrorCode.PROTOCOL_ERROR,
    ),
    "the connection window overflowing": (
        frame(http2.FrameType.WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1)),
        http2.ErrorCode.FLOW_CONTROL_ERROR,
    ),
    "SETTINGS of 5 bytes": (
        frame(http2.FrameType.SETTINGS, 0, 0, b"\0" * 5),
        http2.ErrorCode.FRAME_SIZE_ERROR,
    ),
    "a MAX_FRAME_SIZE below 16384": (
        frame(http2.FrameType.SETTINGS, 0, 0, struct.pack(">HI", 5, 100)),
        http2.ErrorCode.PROTOCOL_ERROR,
    ),
    "PUSH_PROMISE from a client": (
        frame(http2.FrameType.PUSH_PROMISE, 0, 1, b"\0\0\0\2"),
        http2.ErrorCode.PROTOCOL_ERROR,
    ),
    "padding past the frame": (
        frame(http2.FrameType.HEADERS, http2.PADDED | http2.END_HEADERS, 1, b"\x09abc"),
        http2.ErrorCode.PROTOCOL_ERROR,
    ),
    "a header index not in the table": (
        frame(http2.FrameType.HEADERS, http2.END_HEADERS, 1, b"\xff\x10"),
        http2.ErrorCode.COMPRESSION_ERROR,
    ),
    "DATA on an idle stream": (
        frame(http2.FrameType.DATA, 0, 7, b"x"),
        http2.ErrorCode.PROTOCOL_ERROR,
    ),
    "RST_STREAM on an idle stream": (
        frame(http2.FrameType.RST_STREAM, 0, 7, b"\0\0\0\0"),
        http2.ErrorCode.PROTOCOL_ERROR,
    ),
    "PING of 7 bytes": (
        frame(http2.FrameType.PING, 0, 0, b"\0" * 7),
        http2.ErrorCode.FRAME_SIZE_ERROR,
    ),
}


@pytest.mark.parametrize("case", sorted(GOAWAY_CASES))
def test_a_connection_error_is_a_goaway_with_its_code(case: str) -> None:
    data, code = GOAWAY_CASES[case]
    server = started()
    with pytest.raises(http2.ProtocolError) as raised:
        server.receive_data(data)
    assert raised.value.code is code
    assert goaway_code(server.data_to_send()) == code
    assert server.receive_data(frame(http2.FrameType.PING, 0, 0, b"\0" * 8)) == []  # closed


def test_not_the_preface_is_refused_at_its_first_byte() -> None:
    server = http2.ServerConnection(LOCAL)
    with pytest.raises(http2.ProtocolError):
        server.receive_data(b"GET / HTTP/1.1\r\n")


def test_more_data_than_the_connection_window_is_a_flow_control_error() -> None:
    server = http2.ServerConnection(http2.LocalSettings(65535, 1 << 20, 4, 4096))
    server.initiate()
    server.receive_data(
        http2.PREFACE
        + frame(http2.FrameType.HEADERS, http2.END_HEADERS, 1, encode_headers(REQUEST))
    )
    server.receive_data(frame(http2.FrameType.DATA, 0, 1, b"x" * 65535))
    with pytest.raises(http2.ProtocolError) as raised:
        server.receive_data(frame(http2.FrameType.DATA, 0, 1, b"x"))
    assert raised.value.code is http2.ErrorCode.FLOW_CONTROL_ERROR


def test_a_stream_error_resets_that_stream_only() -> None:
    server = started()
    opened = frame(http2.FrameType.HEADERS, http2.END_HEADERS, 1, encode_headers(REQUEST))
    opened += frame(http2.FrameType.HEADERS, http2.END_HEADERS, 3, encode_headers(REQUEST))
    assert len(server.receive_data(opened)) == 2
    events = server.receive_data(frame(http2.FrameType.WINDOW_UPDATE, 0, 1, b"\0\0\0\0"))
    assert events == [http2.StreamReset(1)]
    assert rst_codes(server.data_to_send()) == [(1, http2.ErrorCode.PROTOCOL_ERROR)]
    server.send_headers(3, [(":status", "200")], end_stream=True)  # the other goes on


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 12), st.integers(0, 255), st.integers(0, 9), st.binary(max_size=64)
        ),
        max_size=12,
    )
)
def test_arbitrary_frames_give_events_or_a_goaway(
    frames: list[tuple[int, int, int, bytes]],
) -> None:
    server = started()
    try:
        for kind, flags, stream_id, payload in frames:
            for event in server.receive_data(frame(kind, flags, stream_id, payload)):
                assert isinstance(event, http2.Event)
    except http2.ProtocolError:
        assert goaway_code(server.data_to_send()) is not None


# -- HPACK ----------------------------------------------------------------------------


def test_the_rfc_examples_with_huffman_and_a_table() -> None:
    """RFC 7541 C.4: three requests, Huffman strings, entries reused from the table."""
    decoder = HeaderDecoder()
    blocks = [
        "828684418cf1e3c2e5f23a6ba0ab90f4ff",
        "828684be5886a8eb10649cbf",
        "828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf",
    ]
    expected = [
        [
            (":method", "GET"),
            (":scheme", "http"),
            (":path", "/"),
            (":authority", "www.example.com"),
        ],
        [
            (":method", "GET"),
            (":scheme", "http"),
            (":path", "/"),
            (":authority", "www.example.com"),
            ("cache-control", "no-cache"),
        ],
        [
            (":method", "GET"),
            (":scheme", "https"),
            (":path", "/index.html"),
            (":authority", "www.example.com"),
            ("custom-key", "custom-value"),
        ],
    ]
    for block, want in zip(blocks, expected, strict=True):
        headers, _ = decoder.decode(bytes.fromhex(block))
        assert [(n.decode(), v.decode()) for n, v in headers] == want


header_lists = st.lists(
    st.lists(
        st.tuples(
            st.sampled_from(["content-type", "x-id", "grpc-timeout", "authorization", "x-long"]),
            st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=300),
        ),
        min_size=1,
        max_size=6,
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=200, deadline=None)
@given(header_lists, st.sampled_from([0, 256, 4096]))
def test_the_decoder_follows_hpacks_encoder_block_after_block(lists: list, table: int) -> None:
    encoder = hpack.Encoder()
    encoder.header_table_size = table  # evictions and a size update in the first block
    decoder = HeaderDecoder()
    for headers in lists:
        decoded, _ = decoder.decode(encoder.encode(headers))
        assert [(n.decode(), v.decode()) for n, v in decoded] == headers


@settings(max_examples=200, deadline=None)
@given(header_lists)
def test_our_blocks_decode_with_hpack(lists: list) -> None:
    decoder = hpack.Decoder()
    for headers in lists:
        assert decoder.decode(encode_headers(headers)) == headers


@pytest.mark.parametrize(
    "block",
    [
        b"\x3f\xe2\x1f",
        b"\x82\x20",
        b"\x40\x85abc",
        b"\x7f\xff\xff\xff\xff\xff\x01",
        b"\x40\x81\xff\x00",
    ],
    ids=[
        "table past the limit",
        "size update after a field",
        "string past the end",
        "huge integer",
        "bad huffman",
    ],
)
def test_bad_blocks_are_compression_errors(block: bytes) -> None:
    with pytest.raises(HeaderBlockError):
        HeaderDecoder().decode(block)


# -- helpers ----------------------------------------------------------------------------


def started() -> http2.ServerConnection:
    server = http2.ServerConnection(LOCAL)
    server.initiate()
    server.receive_data(http2.PREFACE + frame(http2.FrameType.SETTINGS, 0, 0, b""))
    server.data_to_send()
    return server


def frames_of(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out = []
    while data:
        length = int.from_bytes(data[:3], "big")
        out.append((data[3], data[4], int.from_bytes(data[5:9], "big"), data[9 : 9 + length]))
        data = data[9 + length :]
    return out


def goaway_code(data: bytes) -> int | None:
    codes = [
        struct.unpack(">II", p[:8])[1]
        for k, _, _, p in frames_of(data)
        if k == http2.FrameType.GOAWAY
    ]
    return codes[-1] if codes else None


def rst_codes(data: bytes) -> list[tuple[int, int]]:
    return [
        (s, struct.unpack(">I", p)[0])
        for k, _, s, p in frames_of(data)
        if k == http2.FrameType.RST_STREAM
    ]
