"""Which scheduler is active: a token on a single-active-consumer queue, held unacked.

Every scheduler consumes ``topology.scheduler_leader_queue`` with prefetch 1; the one
that receives the token message holds it unacked and is active. When it dies, its
connection closes and the broker gives the token to the next consumer.

One loop decides, woken by a token delivery, by the connection going down or coming
back (``Broker.add_state_listener``), and every ``CHECK_SECONDS``:

- connection down while active: step down at once (the broker requeues the token,
  perhaps to a standby; our open requests are failed by the caller);
- a new token delivery: become active (if we were active already, the channel that held
  the old token died, so that leadership ended first: step down, then up again);
- not active and holding no token: make sure a token exists. A broker restart keeps
  the quorum queue and its token, but a broker whose data was lost, or a token dropped
  by a delivery limit, would leave no scheduler active ever again; so a scheduler that
  holds none and sees none waiting publishes one. Safe with several schedulers: the
  queue keeps at most one waiting token (max-length 1, drop-head), and only the single
  active consumer ever receives one, one at a time.

- active: renew the token every ``renew_every`` seconds. RabbitMQ closes a channel whose
  delivery stays unacked longer than its ``consumer_timeout`` (30 minutes by default, set
  per node; per queue only from 3.12), which would depose every leader after 30 minutes
  and fail its open requests. Renewing makes sure a fresh token waits, then acks the
  held one: the single active consumer (still us) receives the waiting token on the same
  channel, which continues the leadership rather than starting a new one.

Everything happens through the one reconnect path: aio-pika restores the token consumer
with the connection, and the restored consumer gets the (requeued) token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

from shardserve.amqp.broker import Broker
from shardserve.errors import InferenceError
from shardserve.process.waits import set_within
from shardserve.wire import topology
from shardserve.wire.protocol import SchedulerHello

_logger = logging.getLogger(__name__)

CHECK_SECONDS = 2.0
RETRY_SECONDS = 1.0
RENEW_SECONDS = 600.0  # a third of RabbitMQ's default consumer_timeout (30 min); a setting
RENEW_GRACE_SECONDS = 30.0  # how long an acked token's successor may take to arrive


class Leadership:
    """Holds (or waits for) the leadership token; calls ``elect`` / ``depose``."""

    def __init__(
        self,
        broker: Broker,
        scheduler_id: str,
        elect: Callable[[], Awaitable[None]],
        depose: Callable[[str], None],
        *,
        renew_every: float = RENEW_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._broker = broker
        self._me = scheduler_id
        self._elect = elect
        self._depose = depose
        self._renew_every = renew_every
        self._clock = clock
        self.active = False
        self._held: AbstractIncomingMessage | None = None
        self._held_since = 0.0
        self._renewing_on: Any = None  # the channel of the token acked for renewal
        self.renewals = 0
        self._delivered: AbstractIncomingMessage | None = None  # newest, not yet acted on
        self._wake = asyncio.Event()
        self.closing = False

    async def start(self) -> None:
        """Declare the queue, make sure a token exists, then wait for it."""
        await self._broker.declare(topology.scheduler_leader_queue())
        self._broker.add_state_listener(self._on_connection_state)
        await self._ensure_token()
        await self._broker.consume_raw(topology.SCHEDULER_LEADER_QUEUE, self._on_token, prefetch=1)

    async def _on_token(self, incoming: AbstractIncomingMessage) -> None:
        """Hold the token unacked: the broker gives it to the next scheduler when we die."""
        self._delivered = incoming
        self._wake.set()

    def _on_connection_state(self, healthy: bool) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            await set_within(self._wake, CHECK_SECONDS)
            self._wake.clear()
            if self.closing:
                return
            await self._step()

    async def _step(self) -> None:
        if not self._broker.healthy:
            if self.active:
                self._step_down("the scheduler lost its broker connection")
            return
        if self._delivered is not None:
            delivered, self._delivered = self._delivered, None
            if self.active and self._continues(delivered):
                self._renewed(delivered)
                return
            if self.active:
                # A delivery we did not ask for by renewing means the channel that held
                # the token died (a reconnect): our old leadership ended with it.
                self._step_down("the scheduler's broker channel was replaced")
            self._hold(delivered)
            await self._step_up()
        elif self.active:
            await self._renew_if_due()
        else:
            await self._ensure_token()

    def _hold(self, token: AbstractIncomingMessage) -> None:
        self._held, self._held_since, self._renewing_on = token, self._clock(), None

    def _continues(self, delivered: AbstractIncomingMessage) -> bool:
        """The successor of the token we acked to renew, on the same channel."""
        return self._renewing_on is not None and _channel(delivered) is self._renewing_on

    def _renewed(self, delivered: AbstractIncomingMessage) -> None:
        self._hold(delivered)
        self.renewals += 1
        _logger.debug("scheduler %s renewed its leadership token", self._me)

    async def _renew_if_due(self) -> None:
        now = self._clock()
        if self._renewing_on is not None:
            if now - self._held_since >= self._renew_every + RENEW_GRACE_SECONDS:
                self._step_down("the renewed leadership token did not come back")
            return
        held = self._held
        if held is None or now - self._held_since < self._renew_every:
            return
        if not await self._ensure_token():  # the successor waits before the held one goes
            return  # tried again on the next step
        try:
            self._renewing_on = _channel(held)
            await held.ack()
        except Exception as exc:  # the channel is gone: the broker requeued the token
            self._step_down(f"could not renew the leadership token ({exc})")

    async def _step_up(self) -> None:
        self.active = True
        _logger.info("scheduler %s is now the active scheduler", self._me)
        try:
            await self._elect()
        except Exception as exc:  # e.g. the connection dropped meanwhile
            await self._give_back(f"could not take up the leadership ({exc})")

    async def _give_back(self, why: str) -> None:
        """Step down and requeue the token (to us again, if we are still the queue's
        active consumer: a retry, paced by RETRY_SECONDS)."""
        held = self._held
        self._step_down(why)
        await asyncio.sleep(RETRY_SECONDS)
        if held is not None:
            with contextlib.suppress(Exception):  # its channel is gone: requeued already
                await held.reject(requeue=True)
        self._wake.set()

    def _step_down(self, why: str) -> None:
        self.active = False
        self._held, self._renewing_on = None, None
        self._depose(why)

    async def _ensure_token(self) -> bool:
        """Publish a token if none is waiting (a held token is not counted: so, with an
        active scheduler, one extra token waits; the queue keeps no more than one).
        Whether a token waits now."""
        try:
            if await self._broker.ready_count(topology.SCHEDULER_LEADER_QUEUE) > 0:
                return True
            token = SchedulerHello(scheduler=self._me)
            await self._broker.publish("", topology.SCHEDULER_LEADER_QUEUE, token, confirm=True)
            _logger.info("no leadership token was waiting: published one")
            return True
        except InferenceError as exc:  # the broker went away again; retried on the next step
            _logger.warning("could not check the leadership token: %s", exc)
            return False


def _channel(token: AbstractIncomingMessage) -> Any:
    """The channel a delivery came on (aio-pika's underlying channel object)."""
    return getattr(token, "channel", None)
