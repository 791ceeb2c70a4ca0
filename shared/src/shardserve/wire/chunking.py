"""Messages bigger than the broker takes travel as numbered chunks, reassembled on arrival.

RabbitMQ refuses a message above its ``max_message_size`` (16 MiB by default on 4.x), so
a 64 MB activation cannot be one message. ``split`` cuts a body into chunks of at most
the given size (the broker's ``BrokerSettings.max_message_bytes``:
``SHARDSERVE_MAX_MESSAGE_BYTES``, default 8 MiB) with AMQP headers naming the message (a
fresh id), the chunk's index, the chunk count and the total size; a body that fits goes
out as it is, with no headers. ``Reassembler.take`` gives back the whole body when its
last missing chunk arrives, in any order, redeliveries ignored.

Limits, so chunks can never make a consumer hold unbounded memory: a declared total above
``max_total_bytes`` is refused; at most ``max_partial`` messages are incomplete at once
(the oldest is given up past that); an incomplete message not completed within
``expiry_s`` of its first chunk is given up (its sender's deadline has passed by then).

A given-up message is bad input like undecodable bytes, and so is a chunk that contradicts
the ones held for its message (other sizes, a second copy that is no redelivery, a wrong
byte count: that message is given up too). The chunk at hand is refused (ChunkError); the
chunks held before were acked on arrival, so each is kept as a ``Fragment`` (its body,
which the limits above already count, its chunk headers and its ``origin``, what the
consumer records of the delivery) and handed back by ``sweep`` for the consumer to
dead-letter. Late chunks of a message completed or given up are refused too, unless the
broker says they are redeliveries.

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
from typing import Any, Generic, TypeVar

from shardserve.errors import CodecError

FINISHED_IDS_KEPT = 4096  # ids of messages completed or given up, remembered for late chunks
DEFAULT_EXPIRY_S = 120.0  # an incomplete message is given up this long after its first chunk

H_ID, H_INDEX, H_COUNT, H_TOTAL = "x-chunk-id", "x-chunk-index", "x-chunk-count", "x-chunk-total"

Chunk = tuple[bytes, dict[str, Any]]
Origin = TypeVar("Origin")  # what a consumer keeps of each delivery, to dead-letter it


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


@dataclass(frozen=True)
class Fragment(Generic[Origin]):
    """A chunk held for its message, with what dead-lettering it needs should the message
    be given up: it was acked (consumed) on arrival, so the broker cannot move it."""

    body: bytes
    headers: dict[str, Any]  # its chunk headers, as checked (safe to publish again)
    origin: Origin  # where it came from: the consumer's own record of the delivery


@dataclass(frozen=True)
class Abandoned(Generic[Origin]):
    """An incomplete message given up, and why: its fragments are bad input."""

    reason: str
    fragments: tuple[Fragment[Origin], ...]


@dataclass(frozen=True)
class Whole(Generic[Origin]):
    """A message's whole body. When it came as chunks: where each came from (its origin,
    chunk headers and size, in order) and which arrived last, so that all of them can be
    dead-lettered should the body prove undecodable; their bodies are slices of this one
    (the chunks themselves are not kept: a big body is held once)."""

    body: bytes
    chunks: tuple[tuple[Origin, dict[str, Any], int], ...] = ()
    last: int = 0  # index of the chunk that completed it

    def held(self) -> Iterator[Fragment[Origin]]:
        """The chunks held before the last one (acked on arrival), rebuilt from the body."""
        start = 0
        for index, (origin, headers, size) in enumerate(self.chunks):
            if index != self.last:
                yield Fragment(self.body[start : start + size], headers, origin)
            start += size


@dataclass
class _Partial(Generic[Origin]):
    count: int
    total: int
    started: float
    parts: dict[int, Fragment[Origin]] = field(default_factory=dict)
    size: int = 0


class Reassembler(Generic[Origin]):
    """Collects chunks into whole bodies (see the module docstring for the limits)."""

    def __init__(
        self,
        *,
        max_total_bytes: int,
        max_partial: int = 64,
        expiry_s: float = DEFAULT_EXPIRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_total = max_total_bytes
        self._max_partial = max_partial
        self.expiry_s = expiry_s
        self._clock = clock
        self._partial: OrderedDict[str, _Partial[Origin]] = OrderedDict()
        # Recent ids completed or given up: their late chunks are redeliveries or bad input.
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._abandoned: list[Abandoned[Origin]] = []  # given up, until ``sweep`` hands them on
        self.dropped = 0  # incomplete messages given up (expired, evicted or contradicted)

    def __len__(self) -> int:
        return len(self._partial)

    def take(
        self,
        headers: Mapping[str, Any] | None,
        body: bytes,
        origin: Origin,
        *,
        redelivered: bool = False,
    ) -> bytes | None:
        """The whole body once complete; None while chunks are missing (``take_whole``
        says more: where each chunk came from)."""
        whole = self.take_whole(headers, body, origin, redelivered=redelivered)
        return None if whole is None else whole.body

    def take_whole(
        self,
        headers: Mapping[str, Any] | None,
        body: bytes,
        origin: Origin,
        *,
        redelivered: bool = False,
    ) -> Whole[Origin] | None:
        """The whole message once complete; None while chunks are missing. A body without
        chunk headers is whole already. ChunkError for a chunk that cannot belong to a
        well-formed message. One that contradicts the chunks held for its message (its
        sizes, a second copy that is no redelivery, a wrong byte count) gives that message
        up as well: ``sweep`` hands on the fragments it held."""
        if not headers or H_ID not in headers:
            return Whole(body)
        message_id, index, count, total = _chunk_fields(headers)
        self._expire()
        if message_id in self._finished:
            if redelivered:
                return None  # a redelivered chunk of a message already handed on or given up
            raise ChunkError(f"chunk {index} of message {message_id}, already complete or given up")
        partial = self._partial.get(message_id)
        if partial is None:
            partial = self._open(message_id, count, total)
        if index in partial.parts and redelivered:
            return None  # the broker sent it again (its ack was lost): already have it
        problem = _contradiction(partial, index, count, total, len(body))
        if problem:
            self._give_up(message_id, f"message {message_id}: {problem}")
            raise ChunkError(f"message {message_id}: {problem}")
        partial.parts[index] = Fragment(body, _headers(message_id, index, count, total), origin)
        partial.size += len(body)
        if len(partial.parts) < partial.count:
            return None
        del self._partial[message_id]
        self._remember_finished(message_id)
        return _joined(partial, index)

    def sweep(self) -> list[Abandoned[Origin]]:
        """The messages given up since the last sweep (the expired ones checked now): the
        fragments they held are to be dead-lettered. Call it after each ``take`` and now
        and then besides, so that an expiry fires on a queue where nothing else arrives."""
        self._expire()
        abandoned, self._abandoned = self._abandoned, []
        return abandoned

    def _open(self, message_id: str, count: int, total: int) -> _Partial[Origin]:
        if total > self._max_total:
            raise ChunkError(f"chunked message of {total} bytes exceeds {self._max_total}")
        if count > total:
            raise ChunkError(f"chunked message of {total} bytes cannot have {count} chunks")
        while len(self._partial) >= self._max_partial:
            oldest = next(iter(self._partial))
            limit = self._max_partial
            self._give_up(oldest, f"message {oldest} evicted: over {limit} incomplete at once")
        partial: _Partial[Origin] = _Partial(count, total, self._clock())
        self._partial[message_id] = partial
        return partial

    def _remember_finished(self, message_id: str) -> None:
        self._finished[message_id] = None
        if len(self._finished) > FINISHED_IDS_KEPT:
            self._finished.popitem(last=False)

    def _give_up(self, message_id: str, reason: str) -> None:
        """Forget an incomplete message (its late chunks are refused) and keep what it
        held for ``sweep``."""
        partial = self._partial.pop(message_id)
        self._remember_finished(message_id)
        if partial.parts:
            self.dropped += 1
            fragments = tuple(partial.parts[i] for i in sorted(partial.parts))
            self._abandoned.append(Abandoned(reason, fragments))

    def _expire(self) -> None:
        now = self._clock()
        while self._partial:
            message_id, oldest = next(iter(self._partial.items()))
            age = now - oldest.started
            if age < self.expiry_s:
                return
            held = f"{len(oldest.parts)} of {oldest.count} chunks"
            self._give_up(message_id, f"message {message_id} incomplete after {age:.0f} s ({held})")


def _contradiction(
    partial: _Partial[Any], index: int, count: int, total: int, size: int
) -> str | None:
    """What makes a chunk impossible beside those already held for its message."""
    if (partial.count, partial.total) != (count, total):
        return f"chunk {index} disagrees on its size"
    if index in partial.parts:
        return f"chunk {index} arrived twice (not a redelivery)"
    if partial.size + size > partial.total:
        return "its chunks exceed its declared size"
    completes = len(partial.parts) + 1 == partial.count
    if completes and partial.size + size != partial.total:
        return f"it has {partial.size + size} of {partial.total} bytes"
    return None


def _joined(partial: _Partial[Origin], last: int) -> Whole[Origin]:
    fragments = [partial.parts[i] for i in range(partial.count)]
    body = b"".join(f.body for f in fragments)
    return Whole(body, tuple((f.origin, f.headers, len(f.body)) for f in fragments), last)


def _headers(message_id: str, index: int, count: int, total: int) -> dict[str, Any]:
    return {H_ID: message_id, H_INDEX: index, H_COUNT: count, H_TOTAL: total}


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
