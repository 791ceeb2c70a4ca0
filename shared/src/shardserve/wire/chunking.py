"""Messages bigger than the broker takes travel as numbered chunks, reassembled on arrival.

RabbitMQ refuses a message above its ``max_message_size`` (16 MiB by default on 4.x), so
a 64 MB activation cannot be one message. ``split`` cuts a body into chunks of at most
the given size (the broker's ``BrokerSettings.max_message_bytes``:
``SHARDSERVE_MAX_MESSAGE_BYTES``, default 8 MiB) with AMQP headers naming the message (a
fresh id), the chunk's index, the chunk count and the total size; a body that fits goes
out as it is, with no headers. ``Reassembler.take`` gives back the whole body when its
last missing chunk arrives, in any order, duplicates ignored.

Limits, so chunks can never make a consumer hold unbounded memory: a declared total above
``max_total_bytes`` is refused; at most ``max_partial`` messages are incomplete at once
(the oldest is dropped past that); an incomplete message not completed within
``expiry_s`` of its first chunk is dropped (its sender's deadline has passed by then).

Chunks of one message must reach one consumer: true for every queue here (one consumer
per work, collective, reply and result queue), and one channel publishes them in order.
So each ``shardserve.amqp.broker.Broker`` holds the one ``Reassembler`` of its consumers;
this module keeps no state of its own.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardserve.errors import CodecError

DONE_IDS_KEPT = 4096  # ids of completed messages remembered, to drop late duplicates

H_ID, H_INDEX, H_COUNT, H_TOTAL = "x-chunk-id", "x-chunk-index", "x-chunk-count", "x-chunk-total"

Chunk = tuple[bytes, dict[str, Any]]


class ChunkError(CodecError):
    """A chunk that cannot belong to a well-formed message (dead-lettered like bad bytes)."""


def split(body: bytes, limit: int) -> list[Chunk]:
    """``body`` as one message (no headers) if it fits in ``limit``, else as chunks."""
    return list(split_pieces([body], limit))


def split_pieces(pieces: Sequence[bytes], limit: int) -> Iterator[Chunk]:
    """The body that ``pieces`` make when joined, cut as ``split`` cuts it. Each chunk is
    joined from views of the pieces it spans when it is taken (so every byte is copied
    once, and a 64 MB body is never held twice)."""
    total = sum(len(p) for p in pieces)
    if total <= limit:
        yield (pieces[0] if len(pieces) == 1 else b"".join(pieces)), {}
        return
    count = -(-total // limit)
    message_id = uuid.uuid4().hex
    for i, body in enumerate(_joined_chunks(pieces, limit)):
        yield body, {H_ID: message_id, H_INDEX: i, H_COUNT: count, H_TOTAL: total}


def _joined_chunks(pieces: Sequence[bytes], limit: int) -> Iterator[bytes]:
    views: list[memoryview] = []
    room = limit
    for piece in pieces:
        view = memoryview(piece)
        while view:
            views.append(view[:room])
            room -= len(views[-1])
            view = view[len(views[-1]) :]
            if room == 0:
                yield b"".join(views)
                views, room = [], limit
    if views:
        yield b"".join(views)


@dataclass
class _Partial:
    count: int
    total: int
    started: float
    parts: dict[int, bytes] = field(default_factory=dict)
    size: int = 0


class Reassembler:
    """Collects chunks into whole bodies (see the module docstring for the limits)."""

    def __init__(
        self,
        *,
        max_total_bytes: int,
        max_partial: int = 64,
        expiry_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_total = max_total_bytes
        self._max_partial = max_partial
        self._expiry = expiry_s
        self._clock = clock
        self._partial: OrderedDict[str, _Partial] = OrderedDict()
        self._done: OrderedDict[str, None] = OrderedDict()  # recent ids, for late duplicates
        self.dropped = 0  # incomplete messages given up (expired or evicted)

    def __len__(self) -> int:
        return len(self._partial)

    def take(self, headers: Mapping[str, Any] | None, body: bytes) -> bytes | None:
        """The whole body once complete; None while chunks are missing. A body without
        chunk headers is whole already."""
        if not headers or H_ID not in headers:
            return body
        message_id, index, count, total = _chunk_fields(headers)
        self._expire()
        if message_id in self._done:
            return None  # a redelivered chunk of a message already handed on
        partial = self._partial.get(message_id)
        if partial is None:
            partial = self._open(message_id, count, total)
        elif (partial.count, partial.total) != (count, total):
            raise ChunkError(f"chunk {index} of message {message_id} disagrees on its size")
        if index in partial.parts:
            return None  # a duplicate (redelivery): already have it
        if partial.size + len(body) > partial.total:
            del self._partial[message_id]
            raise ChunkError(f"chunks of message {message_id} exceed its declared size")
        partial.parts[index] = body
        partial.size += len(body)
        if len(partial.parts) < partial.count:
            return None
        del self._partial[message_id]
        self._done[message_id] = None
        if len(self._done) > DONE_IDS_KEPT:
            self._done.popitem(last=False)
        if partial.size != partial.total:
            raise ChunkError(f"message {message_id} has {partial.size} of {partial.total} bytes")
        return b"".join(partial.parts[i] for i in range(partial.count))

    def _open(self, message_id: str, count: int, total: int) -> _Partial:
        if total > self._max_total:
            raise ChunkError(f"chunked message of {total} bytes exceeds {self._max_total}")
        if count > total:
            raise ChunkError(f"chunked message of {total} bytes cannot have {count} chunks")
        while len(self._partial) >= self._max_partial:
            self._partial.popitem(last=False)
            self.dropped += 1
        partial = self._partial[message_id] = _Partial(count, total, self._clock())
        return partial

    def _expire(self) -> None:
        cutoff = self._clock() - self._expiry
        while self._partial:
            oldest = next(iter(self._partial.values()))
            if oldest.started > cutoff:
                return
            self._partial.popitem(last=False)
            self.dropped += 1


def _chunk_fields(headers: Mapping[str, Any]) -> tuple[str, int, int, int]:
    message_id, index = headers.get(H_ID), headers.get(H_INDEX)
    count, total = headers.get(H_COUNT), headers.get(H_TOTAL)
    if not isinstance(message_id, str | bytes) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in (index, count, total)
    ):
        raise ChunkError("malformed chunk headers")
    assert isinstance(index, int) and isinstance(count, int) and isinstance(total, int)
    if count < 1 or total < 0 or not 0 <= index < count:
        raise ChunkError(f"chunk {index} of {count} is out of range")
    ident = message_id.decode(errors="replace") if isinstance(message_id, bytes) else message_id
    return ident, index, count, total
