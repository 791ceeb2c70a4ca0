"""A collective queue's deliveries, pure: lean parts straight to the hub, messages and
chunks on the slow path, everything undecodable dead-lettered with what identifies it;
and the lean connection's protocol over a fake transport (handshake, deliveries in any
split, the broker closing, heartbeats)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from pamqp import body as pamqp_body
from pamqp import commands
from pamqp import frame as pamqp_frame
from pamqp import header as pamqp_header
from pamqp import heartbeat as pamqp_heartbeat

from shardserve.amqp import frames, lean
from shardserve.amqp.part_inbox import DeadLetter, PartInbox
from shardserve.errors import UnavailableError
from shardserve.wire import chunking, codec, parts
from shardserve.wire.protocol import CollectivePart, JobCancel


def make_part(value: float = 1.5, job: str = "j:1") -> parts.Part:
    return parts.Part(job, 0, 2, 1, "part", np.full((1, 8), value, np.float32))


def lean_body(part: parts.Part) -> bytes:
    return b"".join(parts.encode(part) or [])


def array_of(part: parts.Part | CollectivePart) -> np.ndarray:
    return part.array if isinstance(part, parts.Part) else part.tensor.to_numpy()


def deliver_payload(key: str = "m.1.s0") -> bytes:
    method = commands.Basic.Deliver(
        consumer_tag="c", delivery_tag=9, exchange="shardserve.collective", routing_key=key
    )
    return pamqp_frame.marshal(method, 1)[7:-1]


def header_payload(size: int, props: commands.Basic.Properties | None = None) -> bytes:
    content = pamqp_header.ContentHeader(0, size, props or commands.Basic.Properties())
    return content.marshal()


class Inbox:
    def __init__(self) -> None:
        self.accepted: list[parts.Part | CollectivePart] = []
        self.dead: list[DeadLetter] = []
        self.inbox = PartInbox("shardserve.coll.m.1.r0", self.accepted.append, self.dead.append)

    def take(self, body: bytes, props: commands.Basic.Properties | None = None) -> None:
        self.inbox.take(deliver_payload(), header_payload(len(body), props), body)


def test_a_lean_part_without_properties_reaches_the_hub_decoded() -> None:
    box = Inbox()
    box.take(lean_body(make_part(2.5)))
    [got] = box.accepted
    assert isinstance(got, parts.Part)  # straight from the bytes: no message built
    assert got.job == "j:1" and np.all(got.array == 2.5)
    assert box.dead == []


def test_a_msgpack_part_as_the_broker_publishes_it_is_still_accepted() -> None:
    box = Inbox()
    props = commands.Basic.Properties(content_type=codec.CONTENT_TYPE, message_type="coll.part")
    box.take(codec.encode(make_part(3.0).message()), props)
    assert [array_of(p)[0, 0] for p in box.accepted] == [3.0]


def test_a_malformed_lean_part_is_dead_lettered_not_handed_on() -> None:
    box = Inbox()
    box.take(lean_body(make_part())[:-1])
    assert box.accepted == []
    [dead] = box.dead
    assert "needs 32 bytes, 31 came" in dead.reason
    assert dead.origin.routing_key == "m.1.s0" and dead.origin.queue == box.inbox.queue
    assert box.inbox.dead_lettered == 1


@pytest.mark.parametrize("body", [b"", b"\xc1\xc1", b"SSP1", b"garbage" * 50])
def test_garbage_is_dead_lettered_with_its_message_id(body: bytes) -> None:
    box = Inbox()
    props = commands.Basic.Properties(message_id="fuzz-1", content_type="text/plain")
    box.take(body, props)
    [dead] = box.dead
    assert (dead.origin.message_id, dead.origin.content_type) == ("fuzz-1", "text/plain")
    assert dead.body == body and box.accepted == []


def test_another_valid_message_is_dropped_not_dead_lettered() -> None:
    box = Inbox()
    cancel = JobCancel(job="j", servable="m", version=1, reason="r")
    box.take(codec.encode(cancel), commands.Basic.Properties(message_id="x"))
    assert box.accepted == [] and box.dead == []


def test_a_part_over_the_message_limit_comes_back_whole_from_its_chunks() -> None:
    box = Inbox()
    big = make_part(7.0)
    chunks = list(chunking.split_pieces([lean_body(big)], 10))
    assert len(chunks) > 3
    for chunk, headers in reversed(chunks):  # in any order
        box.take(chunk, commands.Basic.Properties(headers=headers))
    [got] = box.accepted
    assert np.array_equal(array_of(got), big.array) and box.dead == []


def test_every_chunk_of_a_message_undecodable_once_whole_is_dead_lettered() -> None:
    box = Inbox()
    chunks = list(chunking.split_pieces([lean_body(make_part())[:-1]], 20))  # a byte short
    for index, (chunk, headers) in enumerate(chunks):
        box.take(chunk, commands.Basic.Properties(headers=headers, message_id=f"c{index}"))
    assert box.accepted == []
    assert sorted(d.origin.message_id or "" for d in box.dead) == [
        f"c{i}" for i in range(len(chunks))
    ]


def test_chunks_of_a_message_given_up_are_dead_lettered_each() -> None:
    box = Inbox()
    chunks = list(chunking.split_pieces([lean_body(make_part())], 40))
    first, headers = chunks[0]
    box.take(first, commands.Basic.Properties(headers=headers, message_id="a"))
    box.take(first, commands.Basic.Properties(headers=headers, message_id="b"))  # twice
    assert box.accepted == []
    reasons = sorted(d.origin.message_id or "" for d in box.dead)
    assert reasons == ["a", "b"]  # the one held, given up, and the contradicting copy
    held = next(d for d in box.dead if d.origin.message_id == "a")
    assert held.chunk_headers is not None and held.chunk_headers[chunking.H_INDEX] == 0


# ---------------------------------------------------------------- the lean connection


class FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def abort(self) -> None:
        self.closed = True

    def close(self) -> None:
        self.closed = True

    def sent(self) -> list[Any]:
        """Every frame written since the protocol header, read by pamqp."""
        stream = b"".join(self.written).removeprefix(frames.PROTOCOL_HEADER)
        out, at = [], 0
        while at < len(stream):
            used, _, frame = pamqp_frame.unmarshal(stream[at:])
            out.append(frame)
            at += used
        return out


def server(*methods: Any, channel: int = 0) -> bytes:
    return b"".join(pamqp_frame.marshal(m, channel) for m in methods)


async def handshake(deliveries: list[tuple[bytes, bytes, bytes]]) -> tuple[Any, FakeTransport]:
    connection = lean.LeanConnection(lambda *d: deliveries.append(d), heartbeat_s=10)
    transport = FakeTransport()
    connection.connection_made(transport)  # type: ignore[arg-type]
    endpoint = lean.endpoint_of("amqp://u%40x:p%3Aw@h:5999/v%2Fhost")
    shaking = asyncio.ensure_future(connection.handshake(endpoint, "agent-x-parts"))
    connection.data_received(
        server(commands.Connection.Start(server_properties={}, mechanisms="PLAIN"))
    )
    connection.data_received(server(commands.Connection.Tune(0, 131072, 60)))
    await asyncio.sleep(0)
    connection.data_received(server(commands.Connection.OpenOk()))
    await asyncio.sleep(0)
    connection.data_received(server(commands.Channel.OpenOk(), channel=1))
    await shaking
    return connection, transport


async def test_the_handshake_says_who_we_are_and_takes_the_brokers_frame_size() -> None:
    connection, transport = await handshake([])
    start_ok, tune_ok, open_vhost, open_channel = transport.sent()
    assert start_ok.response == "\0u@x\0p:w"  # PLAIN, from the URL, decoded
    assert start_ok.client_properties["connection_name"] == "agent-x-parts"
    assert (tune_ok.frame_max, tune_ok.heartbeat) == (131072, 10)  # ours: shorter
    assert open_vhost.virtual_host == "v/host"
    assert isinstance(open_channel, commands.Channel.Open)
    assert connection.frame_max == 131072
    connection.abort()


async def test_deliveries_come_whole_however_the_reads_split_them() -> None:
    deliveries: list[tuple[bytes, bytes, bytes]] = []
    connection, _ = await handshake(deliveries)
    body = bytes(range(256)) * 1100  # 281600 bytes: three body frames
    method = commands.Basic.Deliver("c", 1, False, "shardserve.collective", "m.1.s0")
    stream = server(method, pamqp_header.ContentHeader(0, len(body)), channel=1)
    for at in range(0, len(body), 131064):
        stream += server(pamqp_body.ContentBody(body[at : at + 131064]), channel=1)
    stream += server(pamqp_heartbeat.Heartbeat())
    stream += server(method, pamqp_header.ContentHeader(0, 0), channel=1)  # an empty body
    for at in range(0, len(stream), 1000):
        connection.data_received(stream[at : at + 1000])
    assert [d[2] for d in deliveries] == [body, b""]
    assert frames.content_size(deliveries[0][1]) == (len(body), False)
    connection.abort()


async def test_a_channel_closed_by_the_broker_ends_the_connection_with_its_reason() -> None:
    connection, transport = await handshake([])
    declaring = asyncio.ensure_future(connection.consume("q"))
    await asyncio.sleep(0)
    close = commands.Channel.Close(405, "RESOURCE_LOCKED - queue q", 50, 10)
    connection.data_received(server(close, channel=1))
    with pytest.raises(lean.BrokerClosedError, match="405 RESOURCE_LOCKED") as caught:
        await declaring
    assert caught.value.code == 405
    assert isinstance(transport.sent()[-1], commands.Channel.CloseOk) and transport.closed
    with pytest.raises(UnavailableError):
        connection.publish("", "q", [b"x"])


async def test_heartbeats_go_out_and_silence_ends_the_connection() -> None:
    connection, transport = await handshake([])
    connection._beat()  # what the timer calls every half interval
    assert transport.written[-1] == frames.HEARTBEAT_FRAME and not connection.lost.done()
    connection._last_read -= 25  # 25 s of silence: over two intervals of 10 s
    connection._beat()
    assert transport.closed
    assert "no frame from the broker" in str(connection.lost.result())


async def test_a_handler_that_fails_on_one_delivery_does_not_end_the_connection() -> None:
    seen: list[bytes] = []

    def handler(deliver: bytes, header: bytes, body: bytes) -> None:
        if body == b"bad":
            raise RuntimeError("a bug")
        seen.append(body)

    connection, transport = await handshake([])
    connection._on_delivery = handler
    method = commands.Basic.Deliver("c", 1, False, "", "q")
    for body in (b"bad", b"good"):
        frames_ = (method, pamqp_header.ContentHeader(0, len(body)), pamqp_body.ContentBody(body))
        connection.data_received(server(*frames_, channel=1))
    assert seen == [b"good"] and not transport.closed and not connection.lost.done()
    connection.abort()
