"""Generation streams: one GenerateRequest out, its numbered GenerateChunks back, in order.

A ``ChunkStream`` is what a handler iterates: the chunks of one request, checked for
order (``seq`` from 0 with no gap and no duplicate), ending with exactly one outcome: the
last chunk (``finish_reason`` or ``error``), or an error raised here. The stream itself
ends with an error at the request's deadline, when its scheduler is gone, and when its
``TokenPace`` is broken: no first chunk within ``first_s`` of the request (queueing and
prefill), or no chunk within ``between_s`` of the previous one. A generation's time thus
scales with its length (the deadline only bounds it when the caller sets one), while a
stuck sequence still ends.

``StreamTable`` keeps the open streams by AMQP correlation id and owns the publishing
around them (``open``): the GenerateRequest with a fresh correlation id, and a
GenerateCancel whenever the stream is left before its last chunk (the HTTP client went
away, the handler was cancelled, the deadline passed, the chunks came out of order), so
the scheduler stops the sequence and frees its KV cache. The cancel is published in a
task of its own: it must go out even when the handler is being cancelled.

Why the scheduler's id matters: sequences live in the memory of the scheduler that
accepted them. When another scheduler becomes active (MeshStatus/SchedulerHello), or no
status arrives for longer than the gateway's staleness limit, those sequences are gone
and their chunks will never come: the streams fail at once ("the scheduler was lost;
retry") instead of waiting for their deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from shardserve.errors import (
    DeadlineError,
    InferenceError,
    InternalError,
    OverloadedError,
    UnavailableError,
)
from shardserve.wire.protocol import GenerateCancel, GenerateChunk, GenerateRequest

_logger = logging.getLogger(__name__)

# How often a waiting stream looks at its deadline and at the scheduler's liveness.
WATCH_INTERVAL_S = 0.25
SCHEDULER_LOST = "the scheduler was lost; retry"


@dataclass(frozen=True)
class TokenPace:
    """The longest waits for a stream's first chunk and between two chunks (seconds)."""

    first_s: float = 120.0
    between_s: float = 30.0


class StreamPublisher(Protocol):
    """Where the table's messages go (the broker, or a test double)."""

    async def publish_generate(self, request: GenerateRequest, correlation_id: str) -> None:
        """Publish the request (confirmed); raise an InferenceError when it cannot go."""
        ...

    async def publish_cancel(self, cancel: GenerateCancel, servable: str) -> None:
        """Publish the cancel where the request went (so it never overtakes it)."""
        ...


class ChunkStream:
    """The chunks of one generation, in order; iterate with ``async for``.

    Yields every chunk including the last; raises an InferenceError when the stream ends
    without one (deadline, scheduler lost, out of order, broker lost).
    """

    def __init__(
        self,
        deadline: float,
        *,
        wall_clock: Callable[[], float] = time.time,
        scheduler_alive: Callable[[], bool] = lambda: True,
        pace: TokenPace = TokenPace(),
    ) -> None:
        self.deadline = deadline
        self._wall_clock = wall_clock
        self._scheduler_alive = scheduler_alive
        self._pace = pace
        self._last_chunk_at = wall_clock()  # the request's start, then each chunk's arrival
        self._queue: asyncio.Queue[GenerateChunk | InferenceError] = asyncio.Queue()
        self._next_seq = 0
        self.ended = False  # an outcome was decided (last chunk taken in, or an error)
        self.finished_by_scheduler = False  # the scheduler sent the last chunk itself

    def deliver(self, chunk: GenerateChunk) -> None:
        """A chunk arrived from the reply queue (any order the broker gives)."""
        if self.ended:
            return
        if chunk.seq != self._next_seq:
            what = "duplicate" if chunk.seq < self._next_seq else "gap"
            self.fail(
                InternalError(
                    f"generation stream out of order ({what}): "
                    f"expected chunk {self._next_seq}, got {chunk.seq}"
                )
            )
            return
        self._next_seq += 1
        self._last_chunk_at = self._wall_clock()
        self._queue.put_nowait(chunk)
        if chunk.last:
            self.ended = True
            self.finished_by_scheduler = True

    def fail(self, error: InferenceError) -> None:
        """End the stream with ``error`` (ignored when it already has an outcome)."""
        if self.ended:
            return
        self.ended = True
        self._queue.put_nowait(error)

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> GenerateChunk:
        if self.ended and self._queue.empty():
            raise StopAsyncIteration
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._wait_s()):
                    item = await self._queue.get()
                if isinstance(item, InferenceError):
                    raise item
                return item
            self._watch()

    def _wait_s(self) -> float:
        return max(0.0, min(WATCH_INTERVAL_S, self.deadline - self._wall_clock()))

    def _watch(self) -> None:
        """Between waits: end the stream at its deadline or when its scheduler is gone."""
        now = self._wall_clock()
        if now >= self.deadline:
            self.fail(DeadlineError("deadline exceeded while generating"))
        elif not self._scheduler_alive():
            self.fail(UnavailableError(SCHEDULER_LOST))
        elif now - self._last_chunk_at >= self._pace_limit():
            self.fail(DeadlineError(self._pace_message()))

    def _pace_limit(self) -> float:
        return self._pace.between_s if self._next_seq else self._pace.first_s

    def _pace_message(self) -> str:
        if self._next_seq:
            return (
                f"no token for {self._pace.between_s:g} s after chunk {self._next_seq - 1} "
                "(the gateway's --token-timeout)"
            )
        return (
            f"no first token within {self._pace.first_s:g} s (the gateway's --first-token-timeout)"
        )


@dataclass
class _Open:
    stream: ChunkStream
    scheduler: str | None  # the scheduler active when the request was published


class StreamTable:
    """The open generation streams of one gateway, by correlation id."""

    def __init__(
        self,
        publisher: StreamPublisher,
        reply_to: str,
        *,
        max_open: int = 256,
        wall_clock: Callable[[], float] = time.time,
        pace: TokenPace = TokenPace(),
    ) -> None:
        self._publisher = publisher
        self._pace = pace
        self._reply_to = reply_to
        self._max_open = max_open
        self._wall_clock = wall_clock
        self._open: dict[str, _Open] = {}
        self._scheduler: str | None = None
        self._status_fresh: Callable[[], bool] = lambda: True
        self._cancels: set[asyncio.Task[None]] = set()
        self.cancels_published = 0

    @property
    def open_count(self) -> int:
        return len(self._open)

    def watch_status(self, fresh: Callable[[], bool]) -> None:
        """Streams fail when ``fresh()`` turns False (no scheduler status for too long)."""
        self._status_fresh = fresh

    @contextlib.asynccontextmanager
    async def open(self, request: GenerateRequest) -> AsyncIterator[ChunkStream]:
        """Publish ``request`` and yield its stream; leaving early cancels the sequence."""
        remaining = request.deadline - self._wall_clock()
        if remaining <= 0:
            raise DeadlineError("deadline exceeded before the request was sent")
        if len(self._open) >= self._max_open:
            raise OverloadedError(
                f"gateway has {self._max_open} generations open (its limit); retry later"
            )
        correlation_id = uuid.uuid4().hex
        stream = ChunkStream(
            request.deadline,
            wall_clock=self._wall_clock,
            scheduler_alive=self._status_fresh,
            pace=self._pace,
        )
        self._open[correlation_id] = _Open(stream, self._scheduler)
        try:
            async with asyncio.timeout(remaining):
                await self._publisher.publish_generate(request, correlation_id)
        except TimeoutError:
            self._open.pop(correlation_id, None)
            self._cancel_later(request.servable, correlation_id)
            raise DeadlineError("deadline exceeded while sending the request") from None
        except BaseException:
            self._open.pop(correlation_id, None)
            raise
        try:
            yield stream
        finally:
            self._open.pop(correlation_id, None)
            if not stream.finished_by_scheduler:
                stream.fail(UnavailableError("the stream was left before its end"))
                self._cancel_later(request.servable, correlation_id)

    def deliver(self, correlation_id: str, chunk: GenerateChunk) -> bool:
        """Route a chunk to its stream; False when nobody waits for it (late or unknown)."""
        entry = self._open.get(correlation_id)
        if entry is None or entry.stream.ended:
            return False
        entry.stream.deliver(chunk)
        return True

    def scheduler_seen(self, scheduler: str) -> None:
        """A new active scheduler: the streams the previous one accepted are gone."""
        previous, self._scheduler = self._scheduler, scheduler
        if previous is None or previous == scheduler:
            return
        failed = self.fail_all(
            UnavailableError(SCHEDULER_LOST), lambda e: e.scheduler not in (None, scheduler)
        )
        if failed:
            _logger.warning("scheduler changed; failed %d open generation stream(s)", failed)

    def fail_all(
        self, error: InferenceError, which: Callable[[_Open], bool] = lambda _: True
    ) -> int:
        """End the chosen open streams with ``error``; returns how many."""
        chosen = [e for e in self._open.values() if not e.stream.ended and which(e)]
        for entry in chosen:
            entry.stream.fail(error)
        return len(chosen)

    def _cancel_later(self, servable: str, correlation_id: str) -> None:
        cancel = GenerateCancel(reply_to=self._reply_to, correlation_id=correlation_id)
        task = asyncio.create_task(self._publish_cancel(cancel, servable))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _publish_cancel(self, cancel: GenerateCancel, servable: str) -> None:
        try:
            await self._publisher.publish_cancel(cancel, servable)
            self.cancels_published += 1
        except InferenceError as exc:
            # The sequence still ends at its deadline on the scheduler's side.
            _logger.warning("could not publish the cancel of %s: %s", cancel.correlation_id, exc)

    async def drain_cancels(self) -> None:
        """Wait for the cancels being published (shutdown, tests)."""
        if self._cancels:
            await asyncio.gather(*self._cancels, return_exceptions=True)
