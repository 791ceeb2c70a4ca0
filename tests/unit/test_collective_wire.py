"""The lean wire form of a collective part, and the AMQP frames the lean connection cuts
and builds: round trips, every header field checked, any split of the byte stream."""

from __future__ import annotations

import numpy as np
import pytest
from pamqp import body as pamqp_body
from pamqp import commands
from pamqp import frame as pamqp_frame
from pamqp import header as pamqp_header

from shardserve.amqp import frames
from shardserve.errors import CodecError
from shardserve.wire import codec, parts
from shardserve.wire.protocol import CollectivePart
from shardserve.wire.tensors import MAX_RANK


def make_part(array: np.ndarray, **kw: object) -> parts.Part:
    fields: dict[str, object] = dict(job="run:7", stage=1, step=16, rank=3, phase="part")
    fields.update(kw)
    return parts.Part(array=array, **fields)  # type: ignore[arg-type]


def lean(part: parts.Part) -> bytes:
    pieces = parts.encode(part)
    assert pieces is not None
    return b"".join(pieces)


@pytest.mark.parametrize(
    "array",
    [
        np.arange(1024, dtype=np.float32).reshape(1, 1024),
        np.arange(12, dtype=np.float16).reshape(2, 3, 2),
        np.array([[1, -2], [3, 4]], dtype=np.int64),
        np.arange(6, dtype=">i4").reshape(3, 2),  # big-endian: sent little-endian
        np.arange(12, dtype=np.float32).reshape(3, 4).T,  # not contiguous
        np.array([True, False, True]),
        np.float32(2.5).reshape(()),  # a scalar
        np.zeros((0, 8), dtype=np.float32),  # no elements
    ],
)
@pytest.mark.parametrize("phase", ["part", "shard", "reduced"])
def test_a_part_survives_the_lean_form(array: np.ndarray, phase: str) -> None:
    body = lean(make_part(array, phase=phase, job="gén:ü 1"))
    assert parts.is_lean(body)
    got = parts.decode(body)
    assert (got.job, got.stage, got.step, got.rank, got.phase) == ("gén:ü 1", 1, 16, 3, phase)
    assert got.array.shape == array.shape and got.array.dtype == array.dtype.newbyteorder("=")
    assert np.array_equal(got.array, array)
    assert not got.array.flags.writeable  # a view of the body, as a message's tensor is


def test_bfloat16_survives_the_lean_form() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    array = np.array([[1.5, -2.0, 3.25]], dtype=ml_dtypes.bfloat16)
    got = parts.decode(lean(make_part(array)))
    assert got.array.dtype == array.dtype and got.array.tobytes() == array.tobytes()


def test_the_lean_form_sends_the_arrays_own_bytes_behind_a_short_header() -> None:
    part = make_part(np.ones((1, 1024), np.float32))
    header, data = parts.encode(part) or ()
    assert isinstance(data, memoryview) and data.obj is not None  # no copy made
    assert bytes(data) == part.array.tobytes()
    assert len(header) < 64 and len(header) < len(codec.encode(part.message())) - 4096


def test_what_the_lean_form_cannot_carry_goes_as_a_message() -> None:
    strings = make_part(np.array([b"ab"], object))
    assert parts.encode(strings) is None
    assert parts.encode(make_part(np.ones(2, np.float32), step=2**32)) is None
    assert parts.encode(make_part(np.ones(2, np.float32), rank=-1)) is None
    message = make_part(np.full(3, 4.0, np.float32)).message()
    assert isinstance(codec.decode(codec.encode(message)), CollectivePart)
    assert message.tensor.to_numpy().tolist() == [4.0] * 3 and message.rank == 3


def test_a_msgpack_consumer_refuses_a_lean_body_and_the_lean_reader_a_message() -> None:
    part = make_part(np.ones(4, np.float32))
    with pytest.raises(CodecError):
        codec.decode(lean(part))
    message = codec.encode(part.message())
    assert not parts.is_lean(message)
    with pytest.raises(parts.PartError, match="magic"):
        parts.decode(message + bytes(32))


def _patched(body: bytes, at: int, value: bytes) -> bytes:
    return body[:at] + value + body[at + len(value) :]


@pytest.mark.parametrize(
    ("mangle", "problem"),
    [
        (lambda b: b[:10], "shorter than its header"),
        (lambda b: b[:30], "shorter than its header says"),
        (lambda b: b + b"\0", "needs 16 bytes, 17 came"),
        (lambda b: b[:-1], "needs 16 bytes, 15 came"),
        (lambda b: _patched(b, 16, b"\x07"), "phase code 7"),
        (lambda b: _patched(b, 17, bytes([MAX_RANK + 1])), f"{MAX_RANK + 1} dimensions"),
        (lambda b: b.replace(b"<f4", b"<f9"), "unsupported dtype '<f9'"),
        (lambda b: b.replace(b"run:7", b"run:\xff"), "job is not UTF-8"),
        (lambda b: _patched(b, 24, (2).to_bytes(8, "little")), "shape [2] of <f4 needs 8"),
    ],
)
def test_a_malformed_lean_part_is_refused_saying_why(mangle, problem: str) -> None:  # type: ignore[no-untyped-def]
    body = lean(make_part(np.ones(4, np.float32)))
    with pytest.raises(parts.PartError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        parts.decode(mangle(body))


def test_a_bytes_dtype_in_a_lean_header_is_refused() -> None:
    body = lean(make_part(np.ones(4, np.uint8)))
    forged = body.replace(b"|u1", b"bytes").replace(b"\x03\x00\x05\x00", b"\x05\x00\x05\x00")
    with pytest.raises(parts.PartError, match="unsupported dtype 'bytes'"):
        parts.decode(forged)


# ---------------------------------------------------------------- AMQP frames


def _deliver(
    body: bytes, key: str = "m.1.s0", props: commands.Basic.Properties | None = None
) -> bytes:
    deliver = commands.Basic.Deliver(
        consumer_tag="c", delivery_tag=1, exchange="shardserve.collective", routing_key=key
    )
    content = pamqp_header.ContentHeader(0, len(body), props or commands.Basic.Properties())
    out = pamqp_frame.marshal(deliver, 1) + pamqp_frame.marshal(content, 1)
    for at in range(0, len(body), 4088):
        out += pamqp_frame.marshal(pamqp_body.ContentBody(body[at : at + 4088]), 1)
    return out


@pytest.mark.parametrize("step", [1, 3, 7, 4096, 1 << 20])
def test_the_frame_reader_cuts_the_same_frames_however_the_bytes_come(step: int) -> None:
    body = bytes(range(256)) * 40  # 10240 bytes: three body frames of at most 4088
    stream = _deliver(body) + frames.HEARTBEAT_FRAME + _deliver(b"")
    reader = frames.FrameReader(4096)
    got = [f for at in range(0, len(stream), step) for f in reader.feed(stream[at : at + step])]
    assert [f.kind for f in got] == [1, 2, 3, 3, 3, 8, 1, 2]
    assert frames.is_deliver(got[0]) and not frames.is_deliver(got[1])
    assert b"".join(f.payload for f in got[2:5]) == body
    assert frames.content_size(got[1].payload) == (len(body), False)
    assert frames.method_of(got[0]).routing_key == "m.1.s0"  # type: ignore[attr-defined]


def test_the_frame_reader_refuses_what_is_no_frame() -> None:
    with pytest.raises(frames.FrameError, match="frame_max"):
        frames.FrameReader(4096).feed(b"\x03\x00\x01\x00\x01\x00\x00" + bytes(10))
    bad_end = frames.HEARTBEAT_FRAME[:-1] + b"\x00"
    with pytest.raises(frames.FrameError, match="0xce"):
        frames.FrameReader(4096).feed(bad_end)


def test_properties_are_seen_and_read_on_the_slow_path() -> None:
    props = commands.Basic.Properties(message_id="m-1", headers={"x-chunk-id": "c"})
    reader = frames.FrameReader(131072)
    _, header, _ = reader.feed(_deliver(b"abc", props=props))
    assert frames.content_size(header.payload) == (3, True)
    read = frames.properties_of(header.payload)
    assert read.message_id == "m-1" and read.headers == {"x-chunk-id": "c"}


@pytest.mark.parametrize("size", [0, 1, 131064 - 8, 131064, 300_000])
def test_a_publish_is_what_pamqp_reads_back(size: int) -> None:
    body = bytes(i % 251 for i in range(size))
    props = commands.Basic.Properties(headers={"x-chunk-index": 2}, delivery_mode=1)
    stream = frames.publish_method(1, "shardserve.collective", "m.1.s0") + b"".join(
        frames.content_frames(1, [body[: size // 2], body[size // 2 :]], 131072, props.marshal())
    )
    read, at = [], 0
    while at < len(stream):
        used, channel, frame = pamqp_frame.unmarshal(stream[at:])
        assert channel == 1
        read.append(frame)
        at += used
    publish, content, *bodies = read
    assert isinstance(publish, commands.Basic.Publish)
    assert (publish.exchange, publish.routing_key, publish.mandatory) == (
        "shardserve.collective",
        "m.1.s0",
        False,
    )
    assert isinstance(content, pamqp_header.ContentHeader) and content.body_size == size
    assert content.properties.headers == {"x-chunk-index": 2}
    assert all(len(b.value) <= 131072 - 8 for b in bodies)
    assert b"".join(b.value for b in bodies) == body
