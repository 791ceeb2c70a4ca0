"""A rank's collective queue, read: every delivery becomes a part for its hub, or a dead letter.

The hot path: a delivery without properties whose body is a lean part
(``shardserve.wire.parts``) is decoded and handed to the hub at once, in the connection's
``data_received`` (no task, no validation beyond the part's header). Everything else takes
the path every consumer takes (``shardserve.amqp.broker``): properties read, chunks
reassembled (a part above the broker's message limit travels in chunks), the body decoded
as a lean part or a msgpack message. A message that does not decode is counted, logged and
handed to ``dead_letter`` (the link republishes it to the dead-letter exchange, as the
broker does for a no-ack queue); a valid message of another kind is logged and dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pamqp.commands import Basic

from shardserve.amqp import frames
from shardserve.errors import CodecError
from shardserve.wire import chunking, codec, parts
from shardserve.wire.parts import Part
from shardserve.wire.protocol import CollectivePart, Message

_logger = logging.getLogger(__name__)

PartSink = Callable[[Part | CollectivePart], None]  # CollectiveHub.accept


@dataclass(frozen=True)
class Origin:
    """What a dead letter keeps of the delivery it came from."""

    queue: str
    routing_key: str = ""
    message_id: str | None = None
    content_type: str | None = None


@dataclass(frozen=True)
class DeadLetter:
    body: bytes
    origin: Origin
    reason: str
    chunk_headers: dict[str, Any] | None = None  # a given-up chunk's own headers


class PartInbox:
    """Takes the deliveries of one collective queue (see the module docstring)."""

    def __init__(
        self,
        queue: str,
        accept: PartSink,
        dead_letter: Callable[[DeadLetter], None],
        *,
        chunk_expiry_s: float = chunking.DEFAULT_EXPIRY_S,
    ) -> None:
        self.queue = queue
        self._accept = accept
        self._dead_letter = dead_letter
        self._chunks: chunking.Reassembler[Origin] = chunking.Reassembler(
            max_total_bytes=codec.MAX_MESSAGE_BYTES, expiry_s=chunk_expiry_s
        )
        self.dead_lettered = 0

    def take(self, deliver: bytes, header: bytes, body: bytes) -> None:
        """One delivery: its Basic.Deliver and content header payloads, its body."""
        _, has_properties = frames.content_size(header)
        if has_properties or not parts.is_lean(body):
            self._take_slowly(deliver, header, body)
            return
        try:
            part = parts.decode(body)
        except CodecError as exc:
            self._refuse(body, self._origin(deliver, None), exc)
            return
        self._accept(part)

    def _take_slowly(self, deliver: bytes, header: bytes, body: bytes) -> None:
        try:
            properties = frames.properties_of(header)
        except Exception as exc:  # pamqp raises several types; all mean "unreadable"
            self._refuse(body, self._origin(deliver, None), CodecError(f"bad properties: {exc}"))
            return
        origin = self._origin(deliver, properties)
        whole: chunking.Whole[Origin] | None = None
        try:
            whole = self._chunks.take_whole(properties.headers, body, origin)
            if whole is not None:
                self._hand_on(self._decode(whole.body))
        except CodecError as exc:
            self._refuse(body, origin, exc)
            held = [] if whole is None else list(whole.held())
            if held:  # the chunks before this one make the same bad message
                self._dead_letter_chunks(held, f"its message: {exc}")
        self.sweep()

    @staticmethod
    def _decode(body: bytes) -> Part | Message:
        return parts.decode(body) if parts.is_lean(body) else codec.decode(body)

    def _hand_on(self, message: Part | Message) -> None:
        if isinstance(message, Part | CollectivePart):
            self._accept(message)
        else:
            _logger.warning(
                "dropping a %s message on collective queue %s", message.kind, self.queue
            )

    def sweep(self) -> None:
        """Dead-letter the chunks of messages given up (expired, evicted, contradicted)."""
        for abandoned in self._chunks.sweep():
            self._dead_letter_chunks(abandoned.fragments, abandoned.reason)

    def _dead_letter_chunks(
        self, fragments: Sequence[chunking.Fragment[Origin]], reason: str
    ) -> None:
        _logger.warning(
            "dead-lettering %d chunk(s) from %s: %s", len(fragments), self.queue, reason
        )
        for fragment in fragments:
            self.dead_lettered += 1
            self._dead_letter(DeadLetter(fragment.body, fragment.origin, reason, fragment.headers))

    @property
    def holding_chunks(self) -> bool:
        return len(self._chunks) > 0

    def _refuse(self, body: bytes, origin: Origin, problem: CodecError) -> None:
        self.dead_lettered += 1
        _logger.warning("dead-lettering a message from %s: %s", self.queue, problem)
        self._dead_letter(DeadLetter(body, origin, str(problem)))

    def _origin(self, deliver: bytes, properties: Any) -> Origin:
        try:
            method = frames.method_of(frames.Frame(frames.METHOD, 1, deliver))
        except Exception:  # (the broker wrote it: never expected)
            method = None
        routing_key = method.routing_key or "" if isinstance(method, Basic.Deliver) else ""
        if properties is None:
            return Origin(self.queue, routing_key)
        return Origin(self.queue, routing_key, properties.message_id, properties.content_type)
