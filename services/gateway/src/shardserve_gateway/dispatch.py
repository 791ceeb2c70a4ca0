"""Request/reply over AMQP: publish an InferRequest, wait for its InferReply or the deadline.

Each gateway owns one exclusive reply queue (``topology.reply_queue(owner)``). Every HTTP
request gets a fresh uuid as AMQP ``correlation_id`` (the user's request id may repeat)
and one future keyed by it. The reply consumer resolves the future; a reply that comes
after the deadline (or for an id nobody waits for) is counted and dropped.

Requests are published with publisher confirms and ``mandatory``: a full request queue
(``x-overflow: reject-publish``) nacks -> 503 overloaded; an unroutable request (no
scheduler ever declared its queue) is returned -> 503 "scheduler not running". The
whole exchange (publish + wait) runs under one ``asyncio.timeout`` ending at the
deadline, so the answer is 504 at the deadline, never later.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Protocol

from aio_pika.abc import AbstractIncomingMessage

from shardserve import topology
from shardserve.broker import Broker
from shardserve.errors import (
    BadInputError,
    DeadlineError,
    InternalError,
    OverloadedError,
    UnavailableError,
)
from shardserve.protocol import InferReply, InferRequest, Message

_logger = logging.getLogger(__name__)

REPLY_PREFETCH = 256
MIN_TIMEOUT_S = 0.001


class Dispatcher(Protocol):
    """What the HTTP handlers need from the message side (faked in unit tests)."""

    @property
    def available(self) -> bool:
        """Whether requests can be published right now (broker connected, not closed)."""
        ...

    async def call(self, request: InferRequest) -> InferReply:
        """Publish ``request`` and return its reply; raise an InferenceError otherwise."""
        ...


class AmqpDispatcher:
    """The real dispatcher: one reply queue, one future per in-flight correlation id."""

    def __init__(
        self, broker: Broker, owner: str, wall_clock: Callable[[], float] = time.time
    ) -> None:
        self._broker = broker
        self._queue = topology.reply_queue(owner)
        self._wall_clock = wall_clock
        self._pending: dict[str, asyncio.Future[InferReply]] = {}
        self._closed = False
        self.late_replies = 0

    @property
    def available(self) -> bool:
        return self._broker.healthy and not self._closed

    @property
    def inflight(self) -> int:
        """Requests published and still waiting for a reply."""
        return len(self._pending)

    async def start(self) -> None:
        """Declare the exclusive reply queue and start consuming it."""
        await self._broker.declare(self._queue)
        await self._broker.consume(self._queue.name, self._on_reply, prefetch=REPLY_PREFETCH)

    async def close(self) -> None:
        """Fail whatever still waits (after the drain, normally nothing) and refuse new calls."""
        self._closed = True
        for future in self._pending.values():
            if not future.done():
                future.set_exception(UnavailableError("gateway is shutting down"))

    async def call(self, request: InferRequest) -> InferReply:
        if self._closed:
            raise UnavailableError("gateway is shutting down")
        if not self._broker.healthy:
            raise UnavailableError("message broker is unreachable")
        remaining = request.deadline - self._wall_clock()
        if remaining <= 0:
            raise DeadlineError("deadline exceeded before the request was sent")
        correlation_id = uuid.uuid4().hex
        future: asyncio.Future[InferReply] = asyncio.get_running_loop().create_future()
        self._pending[correlation_id] = future
        try:
            async with asyncio.timeout(remaining):
                await self._publish(request, correlation_id)
                return await future
        except TimeoutError:
            raise DeadlineError(f"deadline exceeded: no reply within {remaining:.3g} s") from None
        finally:
            self._pending.pop(correlation_id, None)

    async def _publish(self, request: InferRequest, correlation_id: str) -> None:
        try:
            await self._broker.publish(
                topology.REQUESTS_EXCHANGE,
                request.servable,
                request,
                correlation_id=correlation_id,
                reply_to=self._queue.name,
                deadline=request.deadline,
                confirm=True,
            )
        except OverloadedError as exc:
            raise OverloadedError(f"overloaded: {exc.message}") from exc
        except UnavailableError as exc:
            if not self._broker.healthy:
                raise UnavailableError("message broker is unreachable") from exc
            raise UnavailableError(f"scheduler not running: {exc.message}") from exc

    async def _on_reply(self, message: Message, incoming: AbstractIncomingMessage) -> None:
        future = self._pending.get(incoming.correlation_id or "")
        if future is None or future.done():
            self.late_replies += 1
            _logger.debug("dropping a late or unknown reply %s", incoming.correlation_id)
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
