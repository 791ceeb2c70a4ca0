"""ActionSender: order of publishes, reply bundles only to queues that sent bundles."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from shardserve.errors import UnavailableError
from shardserve.wire import topology
from shardserve.wire.protocol import GenerateChunk, InferReply, InferReplyBundle, StageWork
from shardserve.wire.tensors import Tensor
from shardserve_scheduler.core.actions import PublishStageWork, Reply, SendChunk
from shardserve_scheduler.sender import ActionSender, CancelConsumer


class RecordingBroker:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str, Any]] = []

    async def publish(self, exchange: str, key: str, message: Any, **props: Any) -> None:
        self.sent.append((exchange, key, message))

    async def cancel(self, consumer_tag: str) -> None:
        self.sent.append(("cancel", consumer_tag, None))


def reply(queue: str, n: int) -> Reply:
    return Reply(queue, f"c{n}", InferReply(id=f"r{n}", servable="mlp"))


def work(job: str) -> PublishStageWork:
    x = Tensor(dtype="<f4", shape=(1,), data=b"\0\0\0\0")
    return PublishStageWork(
        StageWork(
            job=job,
            servable="mlp",
            version=1,
            stage=0,
            inputs={"x": x},
            digest="d",
            deadline=time.time() + 5,
            result_to="results",
        )
    )


def sender_for(broker: RecordingBroker) -> ActionSender:
    return ActionSender(
        broker,  # type: ignore[arg-type]
        publish_failed=lambda job, why: None,
        stream_gone=lambda reply_to, correlation_id, why: None,
        start_python=lambda action: None,
        is_active=lambda: True,
    )


async def drain(sender: ActionSender, *items: Any) -> None:
    for item in items:
        sender.put(item)
    sender.close()
    await asyncio.wait_for(sender.run(), 5)


async def test_replies_to_a_bundling_gateway_leave_as_one_bundle_after_the_next_work() -> None:
    broker = RecordingBroker()
    sender = sender_for(broker)
    sender.bundles_understood_by("gw-a")
    await drain(sender, reply("gw-a", 1), reply("plain", 2), reply("gw-a", 3), work("j2"))
    kinds = [(exchange, key, type(message).__name__) for exchange, key, message in broker.sent]
    assert kinds == [
        ("", "plain", "InferReply"),
        (topology.STAGE_EXCHANGE, topology.stage_key("mlp", 1, 0), "StageWork"),
        ("", "gw-a", "InferReplyBundle"),
    ]
    bundle = broker.sent[2][2]
    assert isinstance(bundle, InferReplyBundle)
    assert [(i.correlation_id, i.reply.id) for i in bundle.replies] == [("c1", "r1"), ("c3", "r3")]
    assert (sender.reply_bundles, sender.bundled_replies) == (1, 2)


async def test_a_lone_reply_is_plain_and_replies_precede_a_consumer_cancel() -> None:
    broker = RecordingBroker()
    sender = sender_for(broker)
    sender.bundles_understood_by("gw-a")
    await drain(sender, reply("gw-a", 1), CancelConsumer("ctag"), reply("gw-a", 2))
    assert [(key, type(m).__name__) for _, key, m in broker.sent] == [
        ("gw-a", "InferReply"),
        ("ctag", "NoneType"),
        ("gw-a", "InferReply"),
    ]
    assert broker.sent[0][2].id == "r1"


async def test_queues_never_seen_sending_bundles_get_plain_replies() -> None:
    broker = RecordingBroker()
    await drain(sender_for(broker), reply("other", 1), reply("other", 2))
    assert [type(m).__name__ for _, _, m in broker.sent] == ["InferReply", "InferReply"]


class ConfirmingBroker:
    """Records each publish's start and its confirm (a turn of the loop later) and whether
    it asked for a confirm; chunks of different streams may overlap, one stream's never."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int, bool]] = []

    async def publish(self, exchange: str, key: str, message: Any, **props: Any) -> None:
        stream = props.get("correlation_id", "")
        self.events.append(("start", stream, message.seq, bool(props.get("confirm"))))
        await asyncio.sleep(0)
        self.events.append(("confirmed", stream, message.seq, bool(props.get("confirm"))))


def chunk(stream: str, seq: int, last: bool = False) -> SendChunk:
    message = GenerateChunk(id=stream, seq=seq, text="t", finish_reason="length" if last else None)
    return SendChunk("replies", stream, message)


async def test_a_streams_chunks_all_confirmed_each_after_the_one_before() -> None:
    broker = ConfirmingBroker()
    steps = [[chunk(s, seq, last=seq == 2) for s in ("a", "b")] for seq in range(3)]
    await drain(sender_for(broker), *(c for step in steps for c in step))  # type: ignore[arg-type]
    assert all(confirm for *_, confirm in broker.events)  # one channel: the confirm one
    for stream in ("a", "b"):
        mine = [(what, seq) for what, s, seq, _ in broker.events if s == stream]
        assert mine == [(w, seq) for seq in range(3) for w in ("start", "confirmed")]
    # the two streams' chunks of one step leave together, not one round trip each
    assert [what for what, *_ in broker.events[:4]] == ["start", "start", "confirmed", "confirmed"]


class ReturningBroker(RecordingBroker):
    """Returns every chunk of stream "gone" (its reply queue was deleted)."""

    async def publish(self, exchange: str, key: str, message: Any, **props: Any) -> None:
        if props.get("correlation_id") == "gone":
            raise UnavailableError("no queue takes default:replies (nobody consumes it)")
        await super().publish(exchange, key, message, **props)


async def test_an_undeliverable_chunk_reports_its_stream_gone() -> None:
    broker = ReturningBroker()
    gone: list[tuple[str, str]] = []
    sender = ActionSender(
        broker,  # type: ignore[arg-type]
        publish_failed=lambda job, why: None,
        stream_gone=lambda reply_to, corr, why: gone.append((reply_to, corr)),
        start_python=lambda action: None,
        is_active=lambda: True,
    )
    await drain(sender, chunk("gone", 0), chunk("here", 0), chunk("gone", 1, last=True))
    assert gone == [("replies", "gone")]  # (not for its last chunk: nothing left to end)
    assert [m.id for _, _, m in broker.sent] == ["here"]
