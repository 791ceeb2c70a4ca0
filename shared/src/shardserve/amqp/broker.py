"""Broker access: one robust connection per service, channels by purpose, topology declares.

Channels:
- ``publish``: no confirms; the hot path (stage work, collectives, results, replies).
- ``confirm``: publisher confirms + mandatory; where loss or overload must be seen
  (requests into the bounded request queue, registration verdicts).
- ``consume``: manual acks, explicit prefetch per consumer.

Reconnects happen in one place, aio-pika's robust connection; callbacks flip
``healthy`` so readiness reflects an outage. On a reconnect every queue this broker
declared is declared again with its bindings and every consumer restarted (exclusive
and auto-delete queues die with the old connection), on the consume channel itself, so
a consumer never waits for another channel's restore to get its bindings back.

With several broker URLs (a cluster's nodes, comma-separated in SHARDSERVE_AMQP_URL) the
robust connection's attempts move to the next URL after each failure
(``shardserve.amqp.failover.FailoverConnection``). The first connect takes that same path:
a service started before its broker waits for it (capped exponential back-off, a log line
per attempt; ``BrokerSettings.connect_wait_s`` bounds the wait), so an imperfect start
order (compose, Kubernetes) causes no crash loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustChannel,
)
from aiormq import spec

from shardserve.amqp.failover import FailoverConnection
from shardserve.errors import CodecError, OverloadedError, UnavailableError
from shardserve.process.redact import redact_url
from shardserve.process.settings import BrokerSettings
from shardserve.process.waits import within
from shardserve.wire import chunking, codec
from shardserve.wire.protocol import Message
from shardserve.wire.topology import DEAD_EXCHANGE, EXCHANGES, Binding, Queue

_logger = logging.getLogger(__name__)

# What a broker call raises when the broker or the channel is gone. ChannelInvalidStateError is
# aiormq's RuntimeError (not an AMQPError) for a channel closed a moment ago, as during a
# node's shutdown: it must read as "unavailable" like the rest, not as a bug.
_BROKER_UNAVAILABLE = (
    aio_pika.exceptions.AMQPError,
    aio_pika.exceptions.ChannelInvalidStateError,
    ConnectionError,
    TimeoutError,
)

MessageHandler = Callable[[Message, AbstractIncomingMessage], Awaitable[None]]
# Told of a delivery that does not decode, after it is dead-lettered (e.g. to answer its
# sender, whose AMQP properties survive a body that cannot be read).
UndecodableHandler = Callable[[AbstractIncomingMessage, CodecError], Awaitable[None]]

# Bounds one connect attempt, so a node that black-holes packets is left for the next.
CONNECT_TIMEOUT_S = 5.0
# How often held chunks are checked for expiry besides each delivery (a quiet queue gets
# none): a tenth of the expiry, within these bounds.
SWEEP_INTERVAL_BOUNDS_S = (0.05, 5.0)


class Broker:
    """A service's connection to RabbitMQ, with its channels and declared topology."""

    def __init__(self, settings: BrokerSettings, name: str) -> None:
        self._settings = settings
        self._name = name
        self._connection: FailoverConnection | None = None
        self._publish: AbstractChannel | None = None
        self._confirm: AbstractChannel | None = None
        self._exchanges: dict[str, AbstractExchange] = {}
        self._confirm_exchanges: dict[str, AbstractExchange] = {}
        self._queues: dict[str, AbstractQueue] = {}
        self._bindings: dict[str, tuple[Binding, ...]] = {}
        self._consume_channels: list[AbstractChannel] = []
        self._consumers: dict[str, AbstractQueue] = {}
        self.healthy = False
        self.dead_lettered = 0
        self.reconnects = 0
        # Message ids are unique, so this broker's consumers share one reassembler.
        self._chunks: chunking.Reassembler[Delivery] = chunking.Reassembler(
            max_total_bytes=codec.MAX_MESSAGE_BYTES, expiry_s=settings.chunk_expiry_s
        )
        self._chunk_sweeper: asyncio.Task[None] | None = None  # from the first consume on
        self._state_listeners: list[Callable[[bool], None]] = []

    def add_state_listener(self, listener: Callable[[bool], None]) -> None:
        """Call ``listener(healthy)`` each time the connection is lost (False) or restored
        (True), e.g. to fail at once what waits for a reply that can no longer come."""
        self._state_listeners.append(listener)

    def _notify(self, healthy: bool) -> None:
        for listener in self._state_listeners:
            listener(healthy)

    async def connect(self) -> None:
        """Open the connection and the channels, waiting for a broker to answer: on the
        connection's own reconnect path (back-off, a log line per failed attempt), for as
        long as it takes, or ``connect_wait_s`` at most (then UnavailableError)."""
        connection = await self._first_connection()
        self._connection = connection
        connection.close_callbacks.add(self._on_close)
        connection.reconnect_callbacks.add(self._on_reconnect)
        self._publish = await connection.channel(publisher_confirms=False)
        self._confirm = await connection.channel(publisher_confirms=True, on_return_raises=True)
        await self._declare_exchanges()
        self.healthy = True

    async def connect_unless_stopped(self, stop: asyncio.Event) -> bool:
        """``connect``, given up when ``stop`` is set first (a SIGTERM while the broker is
        still away): True once connected, False when stopped before."""
        connecting = asyncio.ensure_future(self.connect())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait((connecting, stopping), return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if connecting.done():
            connecting.result()  # (raises what the connect raised)
            return True
        connecting.cancel()
        await asyncio.gather(connecting, return_exceptions=True)
        await self.close()
        _logger.info("stopped while waiting for the broker")
        return False

    async def _first_connection(self) -> FailoverConnection:
        """A connection to the first broker URL that answers (tried in order, then round
        robin), closed again if the wait is given up or cancelled."""
        urls = [self._with_options(url) for url in self._settings.urls]
        connection = FailoverConnection(
            urls,
            reconnect_interval=self._settings.reconnect_interval_s,
            max_interval=self._settings.reconnect_max_interval_s,
            fail_fast="0",  # the first connect retries too (aio-pika parses the text)
        )
        wait_s = self._settings.connect_wait_s
        try:
            async with asyncio.timeout(wait_s or None) as scope:
                await connection.connect(timeout=CONNECT_TIMEOUT_S)
        except BaseException:
            await connection.close()
            if scope.expired():
                raise UnavailableError(_gave_up(urls, wait_s, connection.attempts)) from None
            raise
        if connection.attempts > 1:
            _logger.info(
                "broker %s answered after %d attempts", connection.current_url, connection.attempts
            )
        return connection

    def _with_options(self, url: str) -> str:
        sep = "&" if "?" in url else "?"
        return f"{url}{sep}heartbeat={self._settings.heartbeat_s}&name={self._name}"

    @property
    def current_url(self) -> str:
        """The broker this connection uses now (password hidden)."""
        return self._connection.current_url if self._connection is not None else ""

    @property
    def publishable(self) -> bool:
        """Connected now, even while the channels are still being restored after a
        reconnect (``healthy`` turns True only once all of them are): a consumer restored
        early may already answer (an agent's hello to a SchedulerHello); its publish waits
        for the publish channel's restore, bounded by the publish timeout."""
        connection = self._connection
        return self.healthy or (connection is not None and connection.connected.is_set())

    def _on_close(self, *_: Any) -> None:
        if self.healthy:
            _logger.warning("broker connection %s lost; reconnecting", self._name)
        self.healthy = False
        self._notify(False)

    def _on_reconnect(self, *_: Any) -> None:
        self.reconnects += 1
        self.healthy = True
        _logger.info("broker connection %s restored (reconnect #%d)", self._name, self.reconnects)
        self._notify(True)

    async def _declare_exchanges(self) -> None:
        assert self._publish is not None and self._confirm is not None
        for ex in EXCHANGES:
            kind = aio_pika.ExchangeType(ex.kind)
            self._exchanges[ex.name] = await self._publish.declare_exchange(
                ex.name, kind, durable=ex.durable
            )
            self._confirm_exchanges[ex.name] = await self._confirm.get_exchange(ex.name)
        self._exchanges[""] = self._publish.default_exchange
        self._confirm_exchanges[""] = self._confirm.default_exchange

    async def declare(self, queue: Queue, bindings: tuple[Binding, ...] = ()) -> AbstractQueue:
        """Declare a queue and the bindings that target it (idempotent)."""
        assert self._publish is not None
        declared = await self._publish.declare_queue(
            queue.name,
            durable=queue.durable,
            exclusive=queue.exclusive,
            auto_delete=queue.auto_delete,
            arguments=queue.arguments or None,
        )
        own = tuple(b for b in bindings if b.queue == queue.name)
        for b in own:
            await declared.bind(b.exchange, routing_key=b.routing_key)
        self._queues[queue.name] = declared
        self._bindings[queue.name] = own
        return declared

    async def ready_count(self, queue: str) -> int:
        """Messages ready (not delivered) in a queue. UnavailableError when the broker
        cannot answer or the queue does not exist."""
        state = await self.queue_state(queue)
        if state is None:
            raise UnavailableError(f"could not inspect queue {queue}: it does not exist")
        return state.ready

    async def queue_state(self, queue: str) -> QueueState | None:
        """Ready messages and consumers of a queue (None if it does not exist), from a
        passive declare on a channel of its own: a missing queue closes that channel."""
        async with self._side_channel(f"inspect queue {queue}") as channel:
            try:
                declared = await channel.declare_queue(queue, passive=True, robust=False)
            except aio_pika.exceptions.ChannelNotFoundEntity:
                return None
            result = declared.declaration_result
            return QueueState(int(result.message_count or 0), int(result.consumer_count or 0))

    async def unbind(self, binding: Binding) -> None:
        """Remove a binding of an existing queue (on a channel of its own)."""
        async with self._side_channel(f"unbind queue {binding.queue}") as channel:
            declared = await channel.declare_queue(binding.queue, passive=True, robust=False)
            await declared.unbind(binding.exchange, routing_key=binding.routing_key)

    @asynccontextmanager
    async def _side_channel(self, what: str) -> AsyncIterator[AbstractRobustChannel]:
        """A short-lived channel for one inspection or change; its errors (a missing queue
        closes a channel) never touch the publish and consume channels."""
        if not self.healthy or self._connection is None:
            raise UnavailableError("message broker is unreachable")
        connection = self._connection
        try:
            # Bounded: a connection lost mid-call can leave the channel's RPC unanswered,
            # and the caller (the status loop) must not wait for it forever.
            async with asyncio.timeout(self._settings.publish_timeout_s):
                channel = await connection.channel(publisher_confirms=False)
                try:
                    yield channel
                finally:
                    await _close_quietly(channel)
        except _BROKER_UNAVAILABLE as exc:
            raise UnavailableError(f"could not {what}: {exc!r}") from exc

    async def publish(
        self,
        exchange: str,
        routing_key: str,
        message: Message,
        *,
        correlation_id: str | None = None,
        reply_to: str | None = None,
        deadline: float | None = None,
        confirm: bool = False,
    ) -> None:
        """Encode and publish one message; ``confirm`` waits for the broker to take it.
        Large tensor data is spliced into the body uncopied (``codec.encode_sized``)."""
        await self.publish_raw(
            exchange,
            routing_key,
            codec.encode_sized(message),
            correlation_id=correlation_id,
            reply_to=reply_to,
            deadline=deadline,
            confirm=confirm,
            message_type=message.kind,
        )

    async def publish_raw(
        self,
        exchange: str,
        routing_key: str,
        body: bytes | list[bytes],
        *,
        correlation_id: str | None = None,
        reply_to: str | None = None,
        deadline: float | None = None,
        confirm: bool = False,
        message_type: str | None = None,
    ) -> None:
        """Publish bytes as they are (already encoded; or the pieces they are joined from,
        ``codec.encode_pieces``)."""
        if not self.publishable:
            raise UnavailableError("message broker is unreachable")
        # Straight to the channel's aiormq layer with the properties built directly: an
        # ``aio_pika.Message`` costs 25-80 us to build (a lock check per attribute), the
        # properties ~2 us, on every hop; ``Exchange.publish`` makes this same call.
        target = (self._confirm_exchanges if confirm else self._exchanges)[exchange]
        channel = self._confirm if confirm else self._publish
        assert channel is not None
        expiration = _expiration(deadline)
        try:
            # Bounded too: while a channel is being restored this waits for it. A timeout
            # scope, not wait_for: wait_for makes a task of the call (3.11), which costs
            # every hop a task and extra turns of the event loop for a call that is
            # normally done at once.
            async with asyncio.timeout(self._settings.publish_timeout_s):
                underlay = await channel.get_underlay_channel()
            # Above SHARDSERVE_MAX_MESSAGE_BYTES a body goes as chunks (shardserve.wire.chunking).
            pieces = [body] if isinstance(body, bytes) else body
            for part, headers in chunking.split_pieces(pieces, self._settings.max_message_bytes):
                properties = spec.Basic.Properties(
                    content_type=codec.CONTENT_TYPE,
                    headers=headers or None,
                    delivery_mode=1,
                    correlation_id=correlation_id,
                    reply_to=reply_to,
                    expiration=expiration,
                    message_type=message_type,
                )
                await underlay.basic_publish(
                    part,
                    exchange=target.name,
                    routing_key=routing_key,
                    properties=properties,
                    mandatory=confirm,
                    timeout=self._settings.publish_timeout_s,
                )
        except aio_pika.exceptions.DeliveryError as exc:
            raise _delivery_error(exc, exchange, routing_key) from exc
        except _BROKER_UNAVAILABLE as exc:
            raise UnavailableError(f"message broker refused the publish: {exc}") from exc

    async def consume(
        self,
        queue: str,
        handler: MessageHandler,
        *,
        prefetch: int,
        exclusive: bool = False,
        no_ack: bool = False,
        on_undecodable: UndecodableHandler | None = None,
    ) -> str:
        """Consume a declared queue on its own channel; bad messages are dead-lettered
        (and then handed to ``on_undecodable`` when given).

        ``no_ack``: the broker forgets a message once sent (no ack frame per delivery). Only
        for queues that die with their consumer (a reply, result or collective queue):
        there a redelivery could never happen anyway; a bad message is counted and dropped.
        """
        assert self._connection is not None
        channel = await self._connection.channel(publisher_confirms=False)
        await channel.set_qos(prefetch_count=prefetch)
        self._consume_channels.append(channel)
        q = await self._consumable(channel, queue)

        order = InOrder()

        async def on_message(incoming: AbstractIncomingMessage) -> None:
            await self._dispatch(incoming, queue, handler, order, on_undecodable)

        tag = await q.consume(on_message, exclusive=exclusive, no_ack=no_ack)
        self._consumers[tag] = q
        if self._chunk_sweeper is None:
            self._chunk_sweeper = asyncio.create_task(self._sweep_chunks_periodically())
        return tag

    async def consume_raw(
        self,
        queue: str,
        callback: Callable[[AbstractIncomingMessage], Awaitable[None]],
        *,
        prefetch: int,
    ) -> str:
        """Consume a declared queue without decoding or settling: ``callback`` owns the ack
        (e.g. a leadership token held unacked for as long as its holder lives)."""
        assert self._connection is not None
        channel = await self._connection.channel(publisher_confirms=False)
        await channel.set_qos(prefetch_count=prefetch)
        self._consume_channels.append(channel)
        q = await self._consumable(channel, queue)
        tag = await q.consume(callback)
        self._consumers[tag] = q
        return tag

    async def _consumable(self, channel: AbstractChannel, queue: str) -> AbstractQueue:
        """The queue as seen from a consume channel, registered with that (robust) channel
        so that after a reconnect it is re-declared and its consumer restarted.

        ``get_queue(ensure=False)`` registers nothing: consumers would silently stay gone
        after a reconnect, and an exclusive or auto-delete queue (gateway replies and
        status, agent work, collective and control queues) is deleted with the old
        connection, so it must be declared again with its arguments AND bound again
        before its consumer restarts: the restored queue has no bindings, and channels
        are restored in no fixed order. So the bindings are registered here too (binding
        twice is idempotent); aio-pika restores declare, bindings, consumer in that order.
        """
        known = self._queues.get(queue)
        if known is None:
            return await channel.get_queue(queue, ensure=False)
        declared = await channel.declare_queue(
            queue,
            durable=known.durable,
            exclusive=known.exclusive,
            auto_delete=known.auto_delete,
            arguments=known.arguments,
        )
        for b in self._bindings.get(queue, ()):
            await declared.bind(b.exchange, routing_key=b.routing_key)
        return declared

    async def cancel(self, consumer_tag: str) -> None:
        """Stop one consumer; its channel stays open so messages in flight can still be acked.

        The consumer is forgotten at once (a reconnect will not restore it); telling the
        broker is bounded by the publish timeout, since during an outage it would wait for
        the reconnect (the broker drops the consumer with the old connection anyway)."""
        queue = self._consumers.pop(consumer_tag, None)
        if queue is not None:
            await within(queue.cancel(consumer_tag), self._settings.publish_timeout_s)

    async def _dispatch(
        self,
        incoming: AbstractIncomingMessage,
        queue: str,
        handler: MessageHandler,
        order: InOrder,
        on_undecodable: UndecodableHandler | None = None,
    ) -> None:
        before, mine = order.ticket()
        try:
            message = await self._decoded(incoming, queue, on_undecodable)
            if before is not None:
                await before  # the previous delivery has reached its handler
        finally:
            mine.set_result(None)  # (wakes the next delivery after this one's handler starts)
        if message is None:
            return
        async with incoming.process(requeue=False, ignore_processed=True):
            await handler(message, incoming)

    async def _decoded(
        self,
        incoming: AbstractIncomingMessage,
        queue: str,
        on_undecodable: UndecodableHandler | None = None,
    ) -> Message | None:
        """The delivery's message; None when there is nothing to hand over (a chunk of a
        message still incomplete, or a bad message, dead-lettered here)."""
        whole = None
        try:
            whole = self._chunks.take_whole(
                incoming.headers,
                incoming.body,
                Delivery.of(incoming, queue),
                redelivered=bool(incoming.redelivered),
            )
            # A chunk held until its message is whole: acked now (its message is lost with
            # this process either way; if it is given up, the reassembler hands it back
            # to be dead-lettered), and decoded off the loop when big.
            message = None if whole is None else await codec.decode_off_loop(whole.body)
        except CodecError as exc:
            await self._dead_letter(incoming, queue, exc)
            held = [] if whole is None else list(whole.held())
            if held:  # the chunks before this one make the same bad message
                await self._dead_letter_chunks(held, f"its message: {exc}")
            if on_undecodable is not None:
                await on_undecodable(incoming, exc)
            message = None
        if message is None and not incoming.processed:
            await incoming.ack()
        await self._dead_letter_given_up_chunks()
        return message

    async def _dead_letter(
        self, incoming: AbstractIncomingMessage, queue: str, problem: CodecError
    ) -> None:
        """A message no consumer can read: counted, logged, and kept on the dead-letter
        queue from EVERY consumer. The broker moves it there where the queue has a
        dead-letter exchange and the delivery can still be rejected; from a no-ack queue
        (already gone) or one without a dead-letter exchange (agent control, status: their
        messages expire, and expired ones must not pile up there) it is republished here."""
        self.dead_lettered += 1
        _logger.warning("dead-lettering a message from %s: %s", queue, problem)
        known = self._queues.get(queue)
        broker_does_it = known is not None and "x-dead-letter-exchange" in (known.arguments or {})
        if not incoming.processed and broker_does_it:
            await incoming.reject(requeue=False)
            return
        if not incoming.processed:
            await incoming.ack()
        await self._republish_dead(incoming.body, Delivery.of(incoming, queue), str(problem))

    async def _dead_letter_given_up_chunks(self) -> None:
        """The chunks held for messages the reassembler gave up (expired now, evicted,
        contradicted by a chunk)."""
        for abandoned in self._chunks.sweep():
            await self._dead_letter_chunks(abandoned.fragments, abandoned.reason)

    async def _dead_letter_chunks(
        self, fragments: Sequence[chunking.Fragment[Delivery]], reason: str
    ) -> None:
        """Chunks of a bad message (given up by the reassembler, or undecodable once
        whole): acked when they arrived, so republished to the dead-letter exchange here,
        each counted like any other dead letter."""
        queues = ", ".join(sorted({f.origin.queue for f in fragments}))
        _logger.warning("dead-lettering %d chunk(s) from %s: %s", len(fragments), queues, reason)
        for fragment in fragments:
            self.dead_lettered += 1
            await self._republish_dead(fragment.body, fragment.origin, reason, fragment.headers)

    async def _sweep_chunks_periodically(self) -> None:
        """Gives up expired chunks on a queue where nothing else arrives (the broker's one
        owned task, cancelled by ``close``)."""
        low, high = SWEEP_INTERVAL_BOUNDS_S
        interval = min(high, max(low, self._chunks.expiry_s / 10))
        while True:
            await asyncio.sleep(interval)
            if len(self._chunks) and self.publishable:
                await self._dead_letter_given_up_chunks()

    async def _republish_dead(
        self,
        body: bytes,
        delivery: Delivery,
        reason: str,
        chunk_headers: dict[str, Any] | None = None,
    ) -> None:
        """Publish a dead letter ourselves; a failure is logged (the count stays)."""
        headers = {
            **(chunk_headers or {}),
            "x-shardserve-dead-from": delivery.queue,
            "x-shardserve-reason": reason[:500],
        }
        properties = spec.Basic.Properties(
            content_type=delivery.content_type,
            message_id=delivery.message_id,
            headers=headers,
            delivery_mode=1,
        )
        try:
            assert self._publish is not None
            underlay = await self._publish.get_underlay_channel()
            await underlay.basic_publish(
                body,
                exchange=DEAD_EXCHANGE,
                routing_key=delivery.routing_key,
                properties=properties,
                timeout=self._settings.publish_timeout_s,
            )
        except Exception as exc:
            _logger.warning("could not republish a dead letter from %s: %r", delivery.queue, exc)

    async def close(self) -> None:
        """Close channels and the connection, in reverse order of opening."""
        self.healthy = False
        if self._chunk_sweeper is not None:
            self._chunk_sweeper.cancel()
            await asyncio.gather(self._chunk_sweeper, return_exceptions=True)
            self._chunk_sweeper = None
        if self._connection is None:
            return
        for channel in reversed(self._consume_channels):
            await _close_quietly(channel)
        for own in (self._confirm, self._publish):
            if own is not None:
                await _close_quietly(own)
        await self._connection.close()
        self._connection = None


class InOrder:
    """Hands one consumer's deliveries to its handler in arrival order.

    Each delivery is its own task, and a big one is decoded in a thread: without this, a
    small message arriving after a big one would reach the handler first. Agents must take
    stage work in the order it was published (every rank of a stage in the same order, or
    their collectives wait on each other crosswise), and requests are admitted first come
    first served. Only the start of each handler is ordered: a slow handler does not hold
    up the next one."""

    def __init__(self) -> None:
        self._last: asyncio.Future[None] | None = None

    def ticket(self) -> tuple[asyncio.Future[None] | None, asyncio.Future[None]]:
        """(the previous delivery's future, this one's); call on arrival, before any await."""
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        before, self._last = self._last, mine
        return before, mine


@dataclass(frozen=True)
class Delivery:
    """What a dead letter keeps of a delivery: the queue it came from, its routing key,
    and the properties that identify it (its message id, its content type)."""

    queue: str
    routing_key: str
    message_id: str | None
    content_type: str | None

    @classmethod
    def of(cls, incoming: AbstractIncomingMessage, queue: str) -> Delivery:
        return cls(queue, incoming.routing_key or "", incoming.message_id, incoming.content_type)


@dataclass(frozen=True)
class QueueState:
    ready: int  # messages waiting, not delivered
    consumers: int


async def _close_quietly(channel: AbstractChannel) -> None:
    try:
        await channel.close()
    except Exception as exc:  # closing during a broker outage: nothing left to do
        _logger.debug("channel close failed: %s", exc)


def _gave_up(urls: list[str], wait_s: float, attempts: int) -> str:
    where = ", ".join(redact_url(url) for url in urls)
    return f"no broker answered within {wait_s:g} s ({attempts} attempts): {where}"


def _expiration(deadline: float | None) -> str | None:
    """Per-message TTL from an absolute deadline, so late work dies in the queue: the
    wire form, whole milliseconds as text (at least 1)."""
    if deadline is None:
        return None
    return str(max(1, int((deadline - time.time()) * 1000)))


def _delivery_error(exc: Any, exchange: str, key: str) -> Exception:
    frame = getattr(exc, "frame", None)
    if frame is not None and type(frame).__name__ == "Nack":
        return OverloadedError(f"queue behind {exchange or 'default'}:{key} is full")
    return UnavailableError(f"no queue takes {exchange or 'default'}:{key} (nobody consumes it)")
