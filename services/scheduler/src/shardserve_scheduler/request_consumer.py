"""The request queue's consumer: inference and generation requests, and their cancels.

Only the active scheduler consumes it (``start`` when it takes over; ``stop`` at the
drain, or ``stop_after_replies`` on a step-down, behind the replies that fail the open
requests). A request without ``reply_to``, or anything that is not a request, is
dead-lettered and counted; a body that does not decode is dead-lettered by the broker and
answered when its properties say how (``unreadable``).
"""

from __future__ import annotations

import logging

from aio_pika.abc import AbstractIncomingMessage

from shardserve.amqp.broker import Broker
from shardserve.errors import CodecError
from shardserve.wire import topology
from shardserve.wire.protocol import (
    GenerateCancel,
    GenerateRequest,
    InferRequest,
    InferRequestBundle,
    Message,
)
from shardserve_scheduler.core.actions import Action
from shardserve_scheduler.core.generation.sequences import Origin
from shardserve_scheduler.inbox import unbind_other_request_queue
from shardserve_scheduler.intake import RequestIntake
from shardserve_scheduler.machines import Machines
from shardserve_scheduler.sender import ActionSender, CancelConsumer
from shardserve_scheduler.unreadable import answer_unreadable

_logger = logging.getLogger(__name__)

REQUEST_PREFETCH = 256


class RequestConsumer:
    """Owns the request consumer (its tag) and the count of requests dead-lettered."""

    def __init__(
        self,
        broker: Broker,
        kind: topology.RequestQueueType,
        intake: RequestIntake,
        machines: Machines,
        sender: ActionSender,
    ) -> None:
        self._broker = broker
        self._kind = kind
        self.queue = topology.request_queue_name(kind)
        self._intake = intake
        self._machines = machines
        self._sender = sender
        self._consumer = ""
        self.dead_lettered = 0

    async def start(self) -> None:
        await unbind_other_request_queue(self._broker, self._kind)
        self._consumer = await self._broker.consume(
            self.queue,
            self.on_request,
            prefetch=REQUEST_PREFETCH,
            on_undecodable=self._on_unreadable,
        )

    async def stop(self) -> None:
        """Stop consuming now (the drain); the broker's trouble is logged only."""
        consumer, self._consumer = self._consumer, ""
        if not consumer:
            return
        try:
            await self._broker.cancel(consumer)
        except Exception as exc:  # broker gone: nothing more will be delivered anyway
            _logger.warning("could not cancel the request consumer: %s", exc)

    def stop_after_replies(self) -> None:
        """Stop consuming once the sender has sent what is queued before (a step-down)."""
        consumer, self._consumer = self._consumer, ""
        if consumer:
            self._sender.put(CancelConsumer(consumer))

    async def on_request(self, message: Message, incoming: AbstractIncomingMessage) -> None:
        """Broker handler of the request queue."""
        reply_to = incoming.reply_to
        if isinstance(message, GenerateCancel):
            await self._intake.cancel(message)
        elif not reply_to or not _is_request(message):
            await self._dead_letter(message, incoming)
        elif isinstance(message, GenerateRequest):
            correlation_id = incoming.correlation_id or message.id
            await self._intake.generate(Origin(message, reply_to, correlation_id))
        elif isinstance(message, InferRequest | InferRequestBundle):
            # Settled once per message, after all its requests: a bundle's share jobs.
            self._machines.emit_settled(self._admitted(message, incoming, reply_to))

    def _admitted(
        self,
        message: InferRequest | InferRequestBundle,
        incoming: AbstractIncomingMessage,
        reply_to: str,
    ) -> list[Action]:
        if isinstance(message, InferRequestBundle):
            self._sender.bundles_understood_by(reply_to)
            actions: list[Action] = []
            for item in message.requests:
                actions += self._intake.admit(item.request, reply_to, item.correlation_id)
            return actions
        return self._intake.admit(message, reply_to, incoming.correlation_id or message.id)

    async def _on_unreadable(self, incoming: AbstractIncomingMessage, problem: CodecError) -> None:
        """A request body the decoder refused (already dead-lettered): its sender is
        answered when its properties say how (``unreadable``)."""
        answer = answer_unreadable(
            incoming.reply_to, incoming.correlation_id, incoming.type, str(problem)
        )
        if answer is not None:
            self._machines.emit([answer])

    async def _dead_letter(self, message: Message, incoming: AbstractIncomingMessage) -> None:
        self.dead_lettered += 1
        why = "it has no reply_to" if _is_request(message) else "it is not a request"
        _logger.warning(
            "dead-lettering a %s from the request queue: %s (%d so far)",
            message.kind,
            why,
            self.dead_lettered,
        )
        await incoming.reject(requeue=False)


def _is_request(message: Message) -> bool:
    return isinstance(message, InferRequest | InferRequestBundle | GenerateRequest)
