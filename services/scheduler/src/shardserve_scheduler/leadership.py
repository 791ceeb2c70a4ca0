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

Everything happens through the one reconnect path: aio-pika restores the token consumer
with the connection, and the restored consumer gets the (requeued) token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from aio_pika.abc import AbstractIncomingMessage

from shardserve.amqp.broker import Broker
from shardserve.errors import InferenceError
from shardserve.wire import topology
from shardserve.wire.protocol import SchedulerHello

_logger = logging.getLogger(__name__)

CHECK_SECONDS = 2.0
RETRY_SECONDS = 1.0


class Leadership:
    """Holds (or waits for) the leadership token; calls ``elect`` / ``depose``."""

    def __init__(
        self,
        broker: Broker,
        scheduler_id: str,
        elect: Callable[[], Awaitable[None]],
        depose: Callable[[str], None],
    ) -> None:
        self._broker = broker
        self._me = scheduler_id
        self._elect = elect
        self._depose = depose
        self.active = False
        self._held: AbstractIncomingMessage | None = None
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
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), CHECK_SECONDS)
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
            if self.active:
                # We never ack the token, so a new delivery means the channel that held
                # it died (a reconnect): our old leadership ended with it.
                self._step_down("the scheduler's broker channel was replaced")
            self._held, self._delivered = self._delivered, None
            await self._step_up()
        elif not self.active:
            await self._ensure_token()

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
        self._held = None
        self._depose(why)

    async def _ensure_token(self) -> None:
        """Publish a token if none is waiting (a held token is not counted: so, with an
        active scheduler, one extra token waits; the queue keeps no more than one)."""
        try:
            if await self._broker.ready_count(topology.SCHEDULER_LEADER_QUEUE) > 0:
                return
            token = SchedulerHello(scheduler=self._me)
            await self._broker.publish("", topology.SCHEDULER_LEADER_QUEUE, token, confirm=True)
            _logger.info("no leadership token was waiting: published one")
        except InferenceError as exc:  # the broker went away again; retried on the next step
            _logger.warning("could not check the leadership token: %s", exc)
