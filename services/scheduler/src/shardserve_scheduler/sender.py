"""The scheduler's outbox: executes the core's actions one by one, in the order produced.

One task runs ``ActionSender.run``, so every StageWork leaves from one channel in order
(every rank of a stage sees jobs in the same order). Besides the core's actions, the
shell queues two of its own: stop consuming requests (behind the replies of a step-down)
and tell an agent of an unloaded version to leave.

Replies that are ready together (a batch finished, a rank was lost) go to a reply queue
whose owner sends InferRequestBundles as one InferReplyBundle: the run loop takes
everything queued and sends such replies last, one message per reply queue (before a
consumer cancel, which must follow them). Other reply queues get one InferReply per
request, in order, as always.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from shardserve.amqp.broker import Broker
from shardserve.errors import InferenceError
from shardserve.process.lifecycle import request_id_var
from shardserve.wire import topology
from shardserve.wire.protocol import BundledReply, InferReplyBundle, RegistrationVerdict
from shardserve_scheduler.core.actions import (
    Action,
    Cancel,
    Log,
    PublishFree,
    PublishStageWork,
    PublishStep,
    Reply,
    RunPython,
    SendChunk,
)

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CancelConsumer:
    """Stop consuming requests (queued behind the replies of a step-down)."""

    consumer_tag: str


@dataclass(frozen=True)
class SendVerdict:
    """Tell an agent of an unloaded version to leave."""

    verdict: RegistrationVerdict


Outgoing = Action | CancelConsumer | SendVerdict


class ChunkWave:
    """Chunks to publish together: at most one per stream, so that a stream's chunks
    never race each other (its next chunk goes in the next wave, after this one's
    confirms); chunks of different streams may leave in any order."""

    def __init__(self) -> None:
        self._chunks: dict[tuple[str, str], SendChunk] = {}

    def takes(self, chunk: SendChunk) -> bool:
        """Add ``chunk`` unless its stream already has one here (False: send this wave)."""
        stream = (chunk.reply_to, chunk.correlation_id)
        if stream in self._chunks:
            return False
        self._chunks[stream] = chunk
        return True

    def take_all(self) -> list[SendChunk]:
        chunks = list(self._chunks.values())
        self._chunks.clear()
        return chunks


# Reply queues remembered as bundle-capable; gateways come and go (each restart is a new
# queue), so the oldest are forgotten past this many (they then get plain replies).
MAX_BUNDLE_QUEUES = 1024
MAX_REPLIES_PER_BUNDLE = 256


class ActionSender:
    """Owns the outbox queue; ``run`` drains it until ``close``."""

    def __init__(
        self,
        broker: Broker,
        *,
        publish_failed: Callable[[str, str], None],
        stream_gone: Callable[[str, str, str], None],
        start_python: Callable[[RunPython], None],
        is_active: Callable[[], bool],
    ) -> None:
        self._broker = broker
        self._publish_failed_job = publish_failed
        self._stream_gone = stream_gone
        self._start_python = start_python
        self._is_active = is_active
        self._outbox: asyncio.Queue[Outgoing | None] = asyncio.Queue()
        self._bundle_queues: dict[str, None] = {}  # insertion-ordered set
        self.reply_bundles = 0
        self.bundled_replies = 0

    def bundles_understood_by(self, reply_to: str) -> None:
        """``reply_to``'s owner sent a bundle: it understands InferReplyBundle too."""
        if reply_to in self._bundle_queues:
            return
        self._bundle_queues[reply_to] = None
        if len(self._bundle_queues) > MAX_BUNDLE_QUEUES:
            del self._bundle_queues[next(iter(self._bundle_queues))]

    def put(self, item: Outgoing) -> None:
        self._outbox.put_nowait(item)

    def close(self) -> None:
        """``run`` finishes what is queued, then ends."""
        self._outbox.put_nowait(None)

    async def run(self) -> None:
        while True:
            items = [await self._outbox.get()]
            while not self._outbox.empty():
                items.append(self._outbox.get_nowait())
            end = None in items
            if end:
                items = items[: items.index(None)]
            await self._execute_all(items)  # type: ignore[arg-type]
            if end:
                return

    async def _execute_all(self, items: list[Outgoing]) -> None:
        """In order, except replies to bundle-capable queues: they wait for the end of the
        run (or a consumer cancel) and leave bundled per queue. The next job's StageWork,
        produced by the same result, so reaches the ranks before the replies are packed."""
        replies: dict[str, list[Reply]] = {}
        wave = ChunkWave()
        for item in items:
            if isinstance(item, SendChunk) and wave.takes(item):
                continue
            await self._send_wave(wave)
            if isinstance(item, SendChunk):
                wave.takes(item)
                continue
            if isinstance(item, Reply) and item.reply_to in self._bundle_queues:
                replies.setdefault(item.reply_to, []).append(item)
                continue
            if isinstance(item, CancelConsumer) and replies:
                await self._send_replies(replies)  # a step-down's replies go first
                replies = {}
            await self._execute(item)
        await self._send_wave(wave)
        if replies:
            await self._send_replies(replies)

    async def _send_wave(self, wave: ChunkWave) -> None:
        """Publish a wave's chunks together (one round trip for their confirms, not one
        each) and empty it; the next wave, which may hold the same streams' next chunks,
        leaves only after every chunk of this one is confirmed."""
        chunks = wave.take_all()
        if len(chunks) == 1:
            await self._execute(chunks[0])
        elif chunks:
            async with asyncio.TaskGroup() as group:  # (a crash cancels the others)
                for chunk in chunks:
                    group.create_task(self._execute(chunk))

    async def _send_replies(self, replies: dict[str, list[Reply]]) -> None:
        for reply_to, queued in replies.items():
            for start in range(0, len(queued), MAX_REPLIES_PER_BUNDLE):
                await self._send_bundle(reply_to, queued[start : start + MAX_REPLIES_PER_BUNDLE])

    async def _send_bundle(self, reply_to: str, replies: list[Reply]) -> None:
        if len(replies) == 1:
            await self._execute(replies[0])
            return
        bundle = InferReplyBundle(
            replies=tuple(
                BundledReply(correlation_id=r.correlation_id, reply=r.reply) for r in replies
            )
        )
        try:
            await self._broker.publish("", reply_to, bundle)
        except InferenceError as exc:
            _logger.warning(
                "%d replies to %s lost (the gateway is gone?): %s", len(replies), reply_to, exc
            )
            return
        self.reply_bundles += 1
        self.bundled_replies += len(replies)

    async def _execute(self, item: Outgoing) -> None:
        if isinstance(item, SendVerdict):
            await self._send_verdict(item.verdict)
        elif isinstance(item, RunPython):
            self._start_python(item)
        elif isinstance(item, CancelConsumer):
            await self._cancel(item.consumer_tag)
        elif isinstance(item, Log):
            token = request_id_var.set(item.request_id)
            _logger.log(item.level, "%s", item.message)
            request_id_var.reset(token)
        else:
            try:
                await self._publish(item)
            except InferenceError as exc:
                self._publish_failed(item, exc)

    async def _cancel(self, consumer_tag: str) -> None:
        try:
            await self._broker.cancel(consumer_tag)
        except Exception as exc:  # the consumer died with the old connection anyway
            _logger.debug("could not cancel the request consumer: %s", exc)

    async def _publish(
        self, action: PublishStageWork | Reply | Cancel | PublishStep | PublishFree | SendChunk
    ) -> None:
        broker = self._broker
        if isinstance(action, PublishStep | PublishFree | SendChunk):
            await self._publish_generation(action)
        elif isinstance(action, PublishStageWork):
            work = action.work
            await broker.publish(
                topology.STAGE_EXCHANGE, action.routing_key, work, deadline=work.deadline
            )
        elif isinstance(action, Reply):
            await broker.publish(
                "", action.reply_to, action.reply, correlation_id=action.correlation_id
            )
        else:
            await broker.publish(topology.CONTROL_EXCHANGE, action.routing_key, action.cancel)

    async def _publish_generation(self, action: PublishStep | PublishFree | SendChunk) -> None:
        """Steps and frees on the stage exchange like StageWork (one channel: one order);
        a stream's chunks in order, its last one confirmed."""
        broker = self._broker
        if isinstance(action, PublishStep):
            work = action.work
            await broker.publish(
                topology.STAGE_EXCHANGE, action.routing_key, work, deadline=work.deadline
            )
        elif isinstance(action, PublishFree):
            await broker.publish(topology.STAGE_EXCHANGE, action.routing_key, action.free)
        else:
            # Every chunk confirmed, on the one confirm channel: RabbitMQ orders messages
            # only within a channel, and a stream's next chunk waits for this one's confirm.
            await broker.publish(
                "",
                action.reply_to,
                action.chunk,
                correlation_id=action.correlation_id,
                confirm=True,
            )

    def _publish_failed(self, action: Action, exc: InferenceError) -> None:
        if isinstance(action, PublishStep):
            _logger.warning("could not publish step %s: %s", action.work.step, exc)
            self._publish_failed_job(action.work.step, exc.message)
        elif isinstance(action, SendChunk):
            # Mandatory and confirmed: a reply queue that vanished returns the chunk.
            _logger.info(
                "chunk %d of %s undeliverable: %s", action.chunk.seq, action.correlation_id, exc
            )
            if not action.chunk.last:
                self._stream_gone(action.reply_to, action.correlation_id, exc.message)
        elif isinstance(action, PublishFree):
            _logger.warning("could not publish a generation message: %s", exc)
        elif isinstance(action, PublishStageWork):
            _logger.warning("could not publish job %s: %s", action.work.job, exc)
            self._publish_failed_job(action.work.job, exc.message)
        elif isinstance(action, Reply):
            token = request_id_var.set(action.reply.id)
            _logger.warning("reply to %s lost (the gateway is gone?): %s", action.reply_to, exc)
            request_id_var.reset(token)
        else:
            _logger.warning("could not publish a job cancel: %s", exc)

    async def _send_verdict(self, verdict: RegistrationVerdict) -> None:
        if not self._is_active():
            return  # the active scheduler tells the agents
        key = topology.agent_control_key(verdict.instance)
        try:
            await self._broker.publish(topology.CONTROL_EXCHANGE, key, verdict, confirm=True)
        except InferenceError as exc:
            _logger.warning("could not tell %s to leave: %s", verdict.instance, exc)
