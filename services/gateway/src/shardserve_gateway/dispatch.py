"""Request/reply over AMQP: publish an InferRequest, wait for its InferReply or the deadline.

Each gateway owns one exclusive reply queue (``topology.reply_queue(owner)``). Every HTTP
request gets a fresh uuid as AMQP ``correlation_id`` (the user's request id may repeat)
and one future keyed by it. The reply consumer resolves the future; a reply that comes
after the deadline (or for an id nobody waits for) is counted and dropped.

Small requests leave through the ``RequestBundler`` (group commit: what piles up while a
publish is in flight leaves as one InferRequestBundle); replies may come back one by one
or as an InferReplyBundle. Requests are published with publisher confirms and
``mandatory``: a full request queue (``x-overflow: reject-publish``) nacks -> 503
overloaded; an unroutable request (no scheduler ever declared its queue) is returned ->
503 "scheduler not running". The whole exchange (publish + wait) runs under one
``asyncio.timeout`` ending at the deadline, so the answer is 504 at the deadline, never
later.

Generation (``generate``): a GenerateRequest is published the same way (routing key = the
servable, ``reply_to`` = this gateway's reply queue, a fresh correlation id) and its
GenerateChunks come back on the same reply queue; ``streams.StreamTable`` keeps them in
order per stream and publishes the GenerateCancel when a stream is left early.

Replies that can never come fail at once (503) instead of waiting for the deadline:
- **scheduler restart**: each pending request remembers the scheduler that was active
  when it was published (from MeshStatus/SchedulerHello); when another scheduler id
  appears, the old scheduler's in-memory request state is gone, so those requests fail
  with "scheduler restarted; request was in flight".
- **broker outage**: the exclusive reply queue dies with the connection (replies sent
  meanwhile are dropped by the broker), so everything pending fails with "broker
  connection lost". New requests get 503 until the robust connection is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from aio_pika.abc import AbstractIncomingMessage

from shardserve.amqp.broker import Broker
from shardserve.errors import (
    BadInputError,
    DeadlineError,
    InferenceError,
    InternalError,
    OverloadedError,
    UnavailableError,
)
from shardserve.wire import codec, topology
from shardserve.wire.protocol import (
    GenerateCancel,
    GenerateChunk,
    GenerateRequest,
    InferReply,
    InferReplyBundle,
    InferRequest,
    InferRequestBundle,
    Message,
    RepositoryCommand,
)
from shardserve_gateway.bundler import Outgoing, RequestBundler
from shardserve_gateway.generation.streams import ChunkStream, StreamTable, TokenPace

_logger = logging.getLogger(__name__)

REPLY_PREFETCH = 256
# A request carrying more tensor bytes than this goes in a message of its own, not bundled.
ALONE_BYTES = 1024 * 1024
MIN_TIMEOUT_S = 0.001
SCHEDULER_RESTARTED = "scheduler restarted; request was in flight"
BROKER_LOST = "broker connection lost; the reply to this request cannot arrive"


class Dispatcher(Protocol):
    """What the HTTP handlers need from the message side (faked in unit tests)."""

    @property
    def available(self) -> bool:
        """Whether requests can be published right now (broker connected, not closed)."""
        ...

    async def call(self, request: InferRequest) -> InferReply:
        """Publish ``request`` and return its reply; raise an InferenceError otherwise."""
        ...

    async def command(self, command: RepositoryCommand) -> None:
        """Publish a model repository command to the scheduler (confirmed)."""
        ...

    def generate(self, request: GenerateRequest) -> AbstractAsyncContextManager[ChunkStream]:
        """Publish a generation; the context yields its chunk stream and, when left before
        the last chunk, cancels the generation."""
        ...


@dataclass
class _Pending:
    future: asyncio.Future[InferReply]
    scheduler: str | None  # the scheduler active when the request was published


class AmqpDispatcher:
    """The real dispatcher: one reply queue, one future per in-flight correlation id."""

    def __init__(
        self,
        broker: Broker,
        owner: str,
        wall_clock: Callable[[], float] = time.time,
        max_inflight: int = 256,
        pace: TokenPace = TokenPace(),
    ) -> None:
        self._broker = broker
        self._max_inflight = max_inflight
        self._queue = topology.reply_queue(owner)
        self._wall_clock = wall_clock
        self._pending: dict[str, _Pending] = {}
        self._closed = False
        self._scheduler: str | None = None
        self.late_replies = 0
        self.failed_early = 0
        self.refused_overload = 0
        self.published = 0
        self.bundler = RequestBundler(self._publish_bundled)
        self._bundler_task: asyncio.Task[None] | None = None
        self.streams = StreamTable(
            self, self._queue.name, max_open=max_inflight, wall_clock=wall_clock, pace=pace
        )

    @property
    def available(self) -> bool:
        return self._broker.healthy and not self._closed

    @property
    def inflight(self) -> int:
        """Requests published and still waiting for a reply."""
        return len(self._pending)

    async def start(self) -> None:
        """Start the bundler; declare the exclusive reply queue, consume it, watch the
        connection."""
        self._bundler_task = asyncio.create_task(self.bundler.run(), name="request-bundler")
        await self._broker.declare(self._queue)
        # No acks: the queue is exclusive, a reply can never be redelivered elsewhere.
        await self._broker.consume(
            self._queue.name, self._on_reply, prefetch=REPLY_PREFETCH, no_ack=True
        )
        self._broker.add_state_listener(self.connection_changed)

    async def close(self) -> None:
        """Fail whatever still waits (after the drain, normally nothing) and refuse new calls."""
        self._closed = True
        if self._bundler_task is not None:
            self._bundler_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._bundler_task
            self._bundler_task = None
        self._fail_pending("gateway is shutting down", lambda _: True)
        self.streams.fail_all(UnavailableError("gateway is shutting down"))
        await self.streams.drain_cancels()

    def scheduler_seen(self, scheduler: str) -> None:
        """A status or hello from ``scheduler``: if it is a new one, fail what the previous
        scheduler had taken (its request state died with it)."""
        previous, self._scheduler = self._scheduler, scheduler
        self.streams.scheduler_seen(scheduler)
        if previous is None or previous == scheduler:
            return
        failed = self._fail_pending(
            SCHEDULER_RESTARTED, lambda p: p.scheduler is not None and p.scheduler != scheduler
        )
        _logger.warning(
            "scheduler changed from %s to %s; failed %d request(s) in flight",
            previous,
            scheduler,
            failed,
        )

    def connection_changed(self, healthy: bool) -> None:
        """The broker connection went down (or came back): replies in flight are lost."""
        if healthy:
            return
        failed = self._fail_pending(BROKER_LOST, lambda _: True)
        failed += self.streams.fail_all(UnavailableError(BROKER_LOST))
        if failed:
            _logger.warning("broker connection lost; failed %d request(s) in flight", failed)

    def _fail_pending(self, message: str, which: Callable[[_Pending], bool]) -> int:
        failed = 0
        for pending in self._pending.values():
            if not pending.future.done() and which(pending):
                pending.future.set_exception(UnavailableError(message))
                failed += 1
        self.failed_early += failed
        return failed

    async def call(self, request: InferRequest) -> InferReply:
        if self._closed:
            raise UnavailableError("gateway is shutting down")
        if not self._broker.healthy:
            raise UnavailableError("message broker is unreachable")
        remaining = request.deadline - self._wall_clock()
        if remaining <= 0:
            raise DeadlineError("deadline exceeded before the request was sent")
        if len(self._pending) >= self._max_inflight:
            # Refuse at once: beyond this bound a flood would only queue up to its deadline.
            self.refused_overload += 1
            raise OverloadedError(
                f"gateway has {self._max_inflight} requests in flight (its limit); retry later"
            )
        correlation_id = uuid.uuid4().hex
        future: asyncio.Future[InferReply] = asyncio.get_running_loop().create_future()
        self._pending[correlation_id] = _Pending(future, self._scheduler)
        try:
            async with asyncio.timeout(remaining):
                await self._publish(request, correlation_id)
                self.published += 1
                return await future
        except TimeoutError:
            raise DeadlineError(f"deadline exceeded: no reply within {remaining:.3g} s") from None
        finally:
            self._pending.pop(correlation_id, None)

    def generate(self, request: GenerateRequest) -> AbstractAsyncContextManager[ChunkStream]:
        if self._closed:
            raise UnavailableError("gateway is shutting down")
        if not self._broker.healthy:
            raise UnavailableError("message broker is unreachable")
        return self.streams.open(request)

    async def publish_generate(self, request: GenerateRequest, correlation_id: str) -> None:
        props = self._properties(request.deadline, correlation_id)
        try:
            await self._broker.publish(
                topology.REQUESTS_EXCHANGE, request.servable, request, **props
            )
        except InferenceError as exc:
            raise self._publish_error(exc) from exc
        self.published += 1

    async def publish_cancel(self, cancel: GenerateCancel, servable: str) -> None:
        await self._broker.publish(topology.REQUESTS_EXCHANGE, servable, cancel, confirm=True)

    async def command(self, command: RepositoryCommand) -> None:
        if self._closed:
            raise UnavailableError("gateway is shutting down")
        if not self._broker.healthy:
            raise UnavailableError("message broker is unreachable")
        try:
            await self._broker.publish(
                topology.CONTROL_EXCHANGE, topology.KEY_SCHEDULER_COMMAND, command, confirm=True
            )
        except UnavailableError as exc:
            if not self._broker.healthy:
                raise UnavailableError("message broker is unreachable") from exc
            raise UnavailableError(f"scheduler not running: {exc.message}") from exc

    async def _publish(self, request: InferRequest, correlation_id: str) -> None:
        size = codec.tensor_payload(request)
        if size <= ALONE_BYTES:
            await self.bundler.send(request, correlation_id, size)
            return
        # Alone: its tensor data is spliced into the body uncopied, and cut in chunks.
        body = codec.encode_sized(request, size)
        props = self._properties(request.deadline, correlation_id)
        try:
            await self._broker.publish_raw(
                topology.REQUESTS_EXCHANGE,
                request.servable,
                body,
                message_type=request.kind,
                **props,
            )
        except InferenceError as exc:
            raise self._publish_error(exc) from exc

    async def _publish_bundled(
        self, message: InferRequest | InferRequestBundle, items: list[Outgoing]
    ) -> None:
        """The bundler's publish: one request (with its correlation id) or a bundle."""
        deadline = max(item.request.deadline for item in items)
        correlation_id = items[0].correlation_id if len(items) == 1 else None
        props = self._properties(deadline, correlation_id)
        try:
            await self._broker.publish(
                topology.REQUESTS_EXCHANGE, items[0].request.servable, message, **props
            )
        except InferenceError as exc:
            raise self._publish_error(exc) from exc

    def _properties(self, deadline: float, correlation_id: str | None) -> dict[str, Any]:
        return dict(
            correlation_id=correlation_id,
            reply_to=self._queue.name,
            deadline=deadline,
            confirm=True,
        )

    def _publish_error(self, exc: InferenceError) -> InferenceError:
        if isinstance(exc, OverloadedError):
            return OverloadedError(f"overloaded: {exc.message}")
        if isinstance(exc, UnavailableError):
            if not self._broker.healthy:
                return UnavailableError("message broker is unreachable")
            return UnavailableError(f"scheduler not running: {exc.message}")
        return exc

    async def _on_reply(self, message: Message, incoming: AbstractIncomingMessage) -> None:
        if isinstance(message, InferReplyBundle):
            for item in message.replies:
                self._resolve(item.correlation_id, item.reply)
            return
        if isinstance(message, GenerateChunk):
            if not self.streams.deliver(incoming.correlation_id or "", message):
                self.late_replies += 1
            return
        self._resolve(incoming.correlation_id or "", message)

    def _resolve(self, correlation_id: str, message: Message) -> None:
        pending = self._pending.get(correlation_id)
        future = pending.future if pending is not None else None
        if future is None or future.done():
            self.late_replies += 1
            _logger.debug("dropping a late or unknown reply %s", correlation_id)
            return
        if isinstance(message, InferReply):
            future.set_result(message)
        else:
            future.set_exception(InternalError(f"unexpected {message.kind} on the reply queue"))


def choose_timeout(
    header: str | None, timeout_ms: object, *, default_s: float, max_s: float
) -> float:
    """The request's timeout in seconds: ``X-Request-Timeout`` header, else the KServe
    ``timeout_ms`` parameter, else the default; capped at ``max_s``."""
    if header is not None:
        try:
            seconds = float(header)
        except ValueError:
            raise BadInputError(f"X-Request-Timeout must be seconds, got {header!r}") from None
    elif timeout_ms is not None:
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int | float):
            raise BadInputError(f"parameter 'timeout_ms' must be a number, got {timeout_ms!r}")
        seconds = float(timeout_ms) / 1000.0
    else:
        return min(default_s, max_s)
    if not seconds > 0 or seconds != seconds or seconds == float("inf"):
        raise BadInputError(f"request timeout must be a positive number of seconds, got {seconds}")
    return max(MIN_TIMEOUT_S, min(seconds, max_s))
