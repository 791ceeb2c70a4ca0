"""The gRPC transport's pure parts: message framing (split, oversized, compressed, a
compression bomb), grpc-timeout, metadata and the status trailers."""

from __future__ import annotations

import gzip
import zlib
from urllib.parse import unquote

import pytest

from shardserve_gateway.grpcapi.transport.wire import (
    CallError,
    MessageReader,
    StatusCode,
    frame,
    metadata_headers,
    metadata_of,
    parse_timeout,
    status_trailers,
)


def compressed(message: bytes, wire: bytes) -> bytes:
    return b"\x01" + len(wire).to_bytes(4, "big") + wire


def test_messages_split_anywhere_come_out_whole() -> None:
    stream = frame(b"first") + frame(b"") + frame(b"x" * 1000)
    for cut in range(len(stream) + 1):
        reader = MessageReader(limit=4096, encoding=None)
        got = list(reader.feed(stream[:cut])) + list(reader.feed(stream[cut:]))
        assert got == [b"first", b"", b"x" * 1000]
        assert not reader.partial


def test_a_message_cut_short_is_partial() -> None:
    reader = MessageReader(limit=4096, encoding=None)
    assert list(reader.feed(frame(b"hello")[:-1])) == []
    assert reader.partial


def test_a_message_over_the_limit_is_refused_from_its_prefix() -> None:
    reader = MessageReader(limit=100, encoding=None)
    with pytest.raises(CallError) as raised:
        list(reader.feed(frame(b"y" * 101)[:5]))  # the length alone is enough
    assert raised.value.code is StatusCode.RESOURCE_EXHAUSTED
    assert "101 vs. 100" in raised.value.message


@pytest.mark.parametrize(
    ("encoding", "pack"),
    [("gzip", gzip.compress), ("deflate", zlib.compress)],
)
def test_compressed_messages_are_inflated(encoding: str, pack: object) -> None:
    message = b"tensor bytes " * 50
    reader = MessageReader(limit=4096, encoding=encoding)
    assert list(reader.feed(compressed(message, pack(message)))) == [message]  # type: ignore[operator]


def test_a_compression_bomb_stops_at_the_limit() -> None:
    bomb = gzip.compress(b"\0" * 50_000_000)  # ~50 KB that inflate to 50 MB
    reader = MessageReader(limit=1 << 20, encoding="gzip")
    with pytest.raises(CallError) as raised:
        list(reader.feed(compressed(b"", bomb)))
    assert raised.value.code is StatusCode.RESOURCE_EXHAUSTED


def test_compressed_without_an_encoding_or_undecodable_is_invalid() -> None:
    with pytest.raises(CallError) as raised:
        list(MessageReader(4096, None).feed(compressed(b"", b"abc")))
    assert raised.value.code is StatusCode.INVALID_ARGUMENT
    with pytest.raises(CallError) as raised:
        list(MessageReader(4096, "gzip").feed(compressed(b"", b"not gzip")))
    assert raised.value.code is StatusCode.INVALID_ARGUMENT


def test_an_unknown_encoding_is_unimplemented() -> None:
    with pytest.raises(CallError) as raised:
        MessageReader(4096, "snappy")
    assert raised.value.code is StatusCode.UNIMPLEMENTED
    assert "identity,gzip,deflate" in raised.value.message


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("1H", 3600.0),
        ("2M", 120.0),
        ("30S", 30.0),
        ("250m", 0.25),
        ("5u", 5e-6),
        ("99999999n", 0.099999999),
    ],
)
def test_grpc_timeouts(value: str, seconds: float) -> None:
    assert parse_timeout(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["", "S", "10", "123456789S", "1.5S", "-1S", "10s", "１S"])
def test_malformed_grpc_timeouts_are_invalid(value: str) -> None:
    with pytest.raises(CallError) as raised:
        parse_timeout(value)
    assert raised.value.code is StatusCode.INVALID_ARGUMENT


def test_metadata_leaves_out_the_protocol_headers_and_decodes_binary_values() -> None:
    headers = [
        (":path", "/p"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("grpc-timeout", "1S"),
        ("authorization", "Bearer t"),
        ("trace-bin", "AAEC"),  # unpadded base64, as grpc sends it
    ]
    assert metadata_of(headers) == (("authorization", "Bearer t"), ("trace-bin", b"\x00\x01\x02"))
    assert metadata_headers((("trace-bin", b"\x00\x01\x02"), ("x-request-id", "r1"))) == [
        ("trace-bin", "AAEC"),
        ("x-request-id", "r1"),
    ]


def test_malformed_binary_metadata_is_invalid() -> None:
    with pytest.raises(CallError) as raised:
        metadata_of([("trace-bin", "!!!")])
    assert raised.value.code is StatusCode.INVALID_ARGUMENT


def test_status_trailers_percent_encode_the_message() -> None:
    trailers = dict(
        status_trailers(StatusCode.NOT_FOUND, "model 'ü' 100% gone\n", (("x-request-id", "r"),))
    )
    assert trailers["grpc-status"] == "5"
    assert trailers["x-request-id"] == "r"
    assert trailers["grpc-message"].isascii() and "\n" not in trailers["grpc-message"]
    assert unquote(trailers["grpc-message"]) == "model 'ü' 100% gone\n"
    assert "grpc-message" not in dict(status_trailers(StatusCode.OK, "", ()))
